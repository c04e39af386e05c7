"""The architecture registry is the one place that branches on an architecture, and the loop knobs have one
validation (`loop_utils.check_loop_knobs`) that the config, the model's forward and `hf_loops.inference` all run."""

import os
import random
import re

import pytest
import torch
from conftest import tiny_qwen3
from helpers.tah2_helpers import tiny_tah2

from hf_loops.analysis.trace import _adapter_for, capture_trace
from hf_loops.conversion import convert_qwen3
from hf_loops.conversion.registry import ARCHITECTURES
from hf_loops.core.trace_adapters import PlainTraceAdapter
from hf_loops.inference import check_model_loop_knobs
from hf_loops.modeling.configuration_tah2 import TaH2Config
from hf_loops.modeling.loop_utils import check_loop_knobs

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hf_loops")
REGISTRY = os.path.join(PACKAGE, "conversion", "registry.py")


def test_no_branch_on_a_model_type_outside_the_registry():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == REGISTRY:
                continue
            for number, line in enumerate(open(path, encoding="utf-8"), start=1):
                if re.search(r"model_type\s*==\s*[\"'](tah2|spiralformer|sgt)[\"']", line):
                    found.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_capture_trace_uses_the_adapter_the_registry_names(arch):
    spec = ARCHITECTURES[arch]
    assert spec.trace_adapter is not None and issubclass(spec.trace_adapter, PlainTraceAdapter)
    layout = {"spiralformer": {"num_pre_layers": 0, "num_loop_layers": 1, "num_post_layers": 1, "chunk_sizes": [2, 1]}}
    model = convert_qwen3(tiny_qwen3(), arch, seed=0, **layout.get(arch, {}))
    assert _adapter_for(model) is spec.trace_adapter
    trace = capture_trace(model, torch.tensor([[3, 4, 5, 6]]), record=("residual",))
    assert trace.model_type == arch
    assert {s.physical_layer for s in trace.steps} == set(range(len(model.model.layers)))  # every layer call mapped
    assert _adapter_for(tiny_qwen3()) is PlainTraceAdapter  # a plain Qwen3: the decoder stack's own


def test_only_tah2_measures_cross_iteration_attention():
    assert {a for a, s in ARCHITECTURES.items() if s.cross_iteration_attention} == {"tah2"}


BAD = [(0, None), (-3, None), (2.0, None), (True, None), ("2", None), (None, 0.0), (None, 1.0), (None, -0.5),
       (None, float("nan")), (None, True), (None, "0.5"), (None, 1.5)]


def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("m,tau", BAD)
def test_config_forward_and_inference_refuse_a_bad_knob_with_the_one_message(m, tau):
    model = tiny_tah2(max_iterations=2)
    ids = torch.tensor([[3, 4, 5]])
    expected = _message(lambda: check_loop_knobs(m, tau))
    assert re.match(r"(max_iterations must be an integer >= 1|exit_threshold must be in the open interval)",
                    expected), expected
    knobs = {k: v for k, v in (("max_iterations", m), ("exit_threshold", tau)) if v is not None}
    assert _message(lambda: model(ids, **knobs)) == expected
    assert _message(lambda: check_model_loop_knobs(model, knobs)) == expected
    assert _message(lambda: TaH2Config(**knobs)) == "TaH2Config." + expected


def test_good_knobs_pass_everywhere_in_a_seeded_sweep():
    rng = random.Random(0)
    model = tiny_tah2(max_iterations=2)
    ids = torch.tensor([[3, 4, 5]])
    for _ in range(6):
        m, tau = rng.randint(1, 4), rng.uniform(0.01, 0.99)
        check_loop_knobs(m, tau)
        check_model_loop_knobs(model, {"max_iterations": m, "exit_threshold": tau})
        assert TaH2Config(max_iterations=m, exit_threshold=tau).max_iterations == m
        with torch.no_grad():
            out = model(ids, max_iterations=m, exit_threshold=tau, use_cache=False)
        assert int(out.iter_counts.max()) <= m
