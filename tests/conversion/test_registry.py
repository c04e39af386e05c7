"""The architecture registry: every entry round-trips convert → report → export → load → card through its spec."""

import os
import re

import pytest
import torch
from helpers.common import tiny_qwen3_config
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

import hf_loops  # noqa: F401
from hf_loops.conversion import convert_qwen3, export
from hf_loops.conversion.model_card import render_model_card
from hf_loops.conversion.registry import ARCHITECTURES, get_spec
from hf_loops.conversion.report import conversion_report


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_round_trips_through_its_spec(name, tmp_path):
    spec = get_spec(name)
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=4)).eval()
    model = convert_qwen3(qwen, name, seed=0)
    assert isinstance(model, spec.model_class) and isinstance(model.config, spec.config_class)
    new = [k for k in model.state_dict() if k not in qwen.state_dict()]
    assert all(k.startswith(spec.new_module_prefixes) for k in new), new[:3]
    report = conversion_report(qwen, model)
    assert report["parity_setting"] == spec.parity_setting
    assert report["parity_max_abs_diff"] is not None and report["parity_max_abs_diff"] < 1e-5
    card = render_model_card(model, source="Qwen/Qwen3-0.6B-Base", report=report)
    assert spec.title in card and spec.arxiv in card and spec.bibtex in card
    for field in spec.summary_fields:
        assert f"`{field}`" in card or not hasattr(model.config, field)
    export(model, str(tmp_path / name), source="tiny")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
    assert type(loaded) is spec.model_class
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = loaded(ids)
        torch.testing.assert_close(out.logits, model(ids).logits)
    assert (getattr(out, "iter_counts", None) is not None) == spec.reports_depth
    assert spec.flops is not None


def test_unknown_architecture_names_the_choices():
    with pytest.raises(ValueError, match=r"arch must be one of \['sgt', 'spiralformer', 'tah2'\]"):
        get_spec("tah3")


def test_no_architecture_branches_outside_the_registry():
    """`if arch == "..."` belongs in a registry entry; conversion, reports, cards and the CLI read the spec."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hf_loops")
    pattern = re.compile(r"""(arch|model_type)\s*[!=]=\s*["'](tah2|spiralformer|sgt)["']""")
    offenders = []
    for folder in ("conversion", "."):
        for fname in os.listdir(os.path.join(root, folder)):
            if fname.endswith(".py") and fname != "registry.py":
                text = open(os.path.join(root, folder, fname), encoding="utf-8").read()
                offenders += [f"{folder}/{fname}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not offenders, offenders


def test_one_flops_entry_dispatches_through_the_registry():
    from hf_loops.analysis import flops
    from hf_loops.core.flops_tah2 import decode_flops_standard, decode_flops_tah2

    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=4)).eval()
    tah2 = convert_qwen3(qwen, "tah2", seed=0)
    depths, prompt = [1, 2, 2, 1], [1, 2, 1]
    assert flops(tah2, prompt, depths) == decode_flops_tah2(tah2.config, depths, prompt)
    assert flops(qwen, prompt, depths) == decode_flops_standard(qwen.config, 3, 4)
    for name in ("spiralformer", "sgt"):
        model = convert_qwen3(qwen, name, seed=0)
        assert flops(model, prompt, [1] * 4) == get_spec(name).flops.decode_flops(model.config, prompt, [1] * 4)
        assert flops(model, prompt, [1] * 4) > 0
