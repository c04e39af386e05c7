"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`, `TrainingTesterMixin`'s overfit test)
run on our looped models.

The test modules are not part of the transformers wheel: `tests/fetch_transformers_tests.py` (run by `make test`)
puts the top-level `tests/*.py` of the installed version's source distribution into a cache outside the
repository. This module only reads that cache; without it, it skips with the reason.

Four testers in the shape of transformers' own Qwen3 tester: TaH2 with M = 1, TaH2 with M = 2 and a learned decider,
SpiralFormer and SGT. A common test that does not apply to a looped model is skipped by name, with its reason, in the
tables below; every other one must pass (the three real bugs these tests found, `return_dict=False` ignored by the
base models, no `_tp_plan`/`_pp_plan` and wrong reentrant-checkpointing gradients, are fixed). The tensor-parallel, FSDP
and pipeline mixins are not run: they need several processes or Hub checkpoints (our own tests cover those paths).
tests/conftest.py prints a per-architecture summary (passed / skipped by name / skipped upstream / xfailed).
"""

from __future__ import annotations

import re
import sys
import types
import unittest

import pytest
from fetch_transformers_tests import PACKAGE, cache_dir, is_complete  # tests/ is on sys.path (the rootdir conftest)

ROOT = cache_dir()
if not is_complete(ROOT):
    pytest.skip(f"transformers' common tests are not in the cache {ROOT}: run `python tests/fetch_transformers_tests.py`"
                " (needs the package registry once)", allow_module_level=True)
pytest.importorskip("parameterized", reason="transformers' common tests need `parameterized` (the dev extra)")

import torch  # noqa: E402

# setup.cfg ignores FutureWarning suite-wide; the common tests assert that deprecation warnings are raised.
pytestmark = pytest.mark.filterwarnings("always::FutureWarning")


def _install_common_tests_package() -> None:
    """Make the cached files importable as the package `transformers_tests`.

    `test_modeling_common.py` and `test_configuration_common.py` import three modules the source distribution does
    not ship (`exporters/test_export.py`, `generation/test_utils.py`, `utils/test_configuration_utils.py`). They get
    stand-ins here, written for this project: no export tests (not shipped), no generation mixin (our own generation
    checks are in tests/modeling/test_transformers_generation.py), and our own set of non-default values for the
    config fields every `PreTrainedConfig` has (what `ConfigTester.check_config_arguments_init` sets and reads back).
    """
    if PACKAGE in sys.modules:
        return
    pkg = types.ModuleType(PACKAGE)
    pkg.__path__ = [str(ROOT / PACKAGE)]
    sys.modules[PACKAGE] = pkg

    def stand_in(name, **attrs):
        parent = name.rpartition(".")[0]
        if f"{PACKAGE}.{parent}" not in sys.modules:
            sub = types.ModuleType(f"{PACKAGE}.{parent}")
            sub.__path__ = []
            sys.modules[f"{PACKAGE}.{parent}"] = sub
        mod = types.ModuleType(f"{PACKAGE}.{name}")
        mod.__dict__.update(attrs)
        sys.modules[mod.__name__] = mod

    stand_in("exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    stand_in("generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
    stand_in("utils.test_configuration_utils", config_common_kwargs={
        "return_dict": False,
        "output_hidden_states": True,
        "dtype": "float16",
        "chunk_size_feed_forward": 5,
        "architectures": ["SomeArchitecture"],
        "id2label": {0: "first", 1: "second"},
        "label2id": {"first": 0, "second": 1},
        "problem_type": "regression",
    })


_install_common_tests_package()

from helpers.looped_tiny_configs import ARCHS  # noqa: E402
from transformers_tests import test_modeling_common as _common  # noqa: E402
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402
from transformers_tests.test_training_mixin import TrainingTesterMixin  # noqa: E402


def _list_our_classes_by_name() -> None:
    """The common tests tell base models from heads by class name (`MODEL_MAPPING_NAMES`: no loss to train,
    `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: labels added). Ours are registered with the Auto classes, not in those
    name tables, so the common-test module gets copies that list them too (transformers' own tables stay as they are:
    a name there makes the lazy Auto mapping import `transformers.models.<type>`)."""
    from collections import OrderedDict

    _common.MODEL_MAPPING_NAMES = OrderedDict(
        {**_common.MODEL_MAPPING_NAMES, **{k: v["base"].__name__ for k, v in _BY_TYPE.items()}})
    _common.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict(
        {**_common.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **{k: v["causal_lm"].__name__ for k, v in _BY_TYPE.items()}})


# ---------------------------------------------------------------------------------------------------------------
# Skips and known bugs, by test name. A parameterized test is named by its base name (it covers every expansion).
# ---------------------------------------------------------------------------------------------------------------

# Every architecture: refusals our looped models make by design, and files transformers does not ship.
_OUTPUT_ATTENTIONS_UNDER_SDPA = ("asks the sdpa model for output_attentions: ours refuse that with a ValueError that "
                                 "names attn_implementation='eager' (Qwen3 silently returns no weights)")
SKIP_ALL: dict[str, str] = {
    "test_generation_tester_mixin_inheritance": "transformers' generation tests are not in the sdist; our own "
                                                "generation checks are test_transformers_generation.py",
    "test_eager_matches_sdpa_inference_24_fp32_pad_left_output_attentions": _OUTPUT_ATTENTIONS_UNDER_SDPA,
}
_TAH2 = {
    "test_sliding_window_mask": "TaH2Config refuses use_sliding_window: the cross-iteration (duo) masks are built for "
                                "full attention",
    "test_attention_outputs": "TaH2ForCausalLM adds per-depth `iteration_hidden_states` to `hidden_states` under "
                              "output_hidden_states=True: two output fields where the test counts one",
    "test_gradient_checkpointing_enable_disable": "TaH2 checkpoints each layer call itself (the stream K/V view must "
                                                  "reach the layer), so the layers' own flag stays False by design",
    "test_peft_gradient_checkpointing_enable_disable": "same as test_gradient_checkpointing_enable_disable: the "
                                                       "model, not each layer, checkpoints the layer calls",
    "test_training_gradient_checkpointing": "mocks the first layer's `_gradient_checkpointing_func`, which TaH2's "
                                            "model-level checkpointing does not set; checkpointed gradients are "
                                            "compared value by value in tests/modeling (reentrant and not, M=1..3)",
    "test_training_gradient_checkpointing_use_reentrant_false": "as test_training_gradient_checkpointing",
    "test_training_gradient_checkpointing_use_reentrant_true": "as test_training_gradient_checkpointing",
}
SKIP_BY_ARCH: dict[str, dict[str, str]] = {
    "tah2_m1": dict(_TAH2, test_model_outputs_equivalence="at M = 1 `continue_probs` is (B, T, 0); the test's failure "
                                                          "message takes torch.max of every tensor, which raises on an "
                                                          "empty one; the same check runs on TaH2 M = 2"),
    "tah2_m2": dict(_TAH2, test_batching_equivalence="`continue_probs` is NaN by design where a token did not run "
                                                     "that depth, and the test refuses any NaN in an output; "
                                                     "batch == single rows is checked by our generation tests"),
    "spiralformer": {
        "test_sliding_window_mask": "SpiralFormerConfig refuses use_sliding_window: chunk latents use full attention",
        "test_attention_outputs": "SpiralFormer refuses output_attentions (its loops attend over compressed latents "
                                  "of varying length; hf_loops.analysis.capture_trace gives the maps)",
        "test_retain_grad_hidden_states_attentions": "needs output_attentions, which SpiralFormer refuses (see "
                                                     "test_attention_outputs)",
    },
    "sgt": {
        "test_can_set_attention_dynamically": "SGT refuses an unknown attn_implementation with its own ValueError "
                                              "(it lists the allowed values); the test matches transformers' wording",
    },
}

# Tests that apply once adapted to a refusal above: `test_model_outputs_equivalence` compares tuple and dict outputs
# with output_attentions too, which our models refuse under the default sdpa: it runs under eager attention
# (SpiralFormer, which refuses output_attentions altogether, runs it without the attention part).
RUN_UNDER_EAGER = {"test_model_outputs_equivalence"}
RUN_WITHOUT_ATTENTIONS = {"spiralformer": {"test_model_outputs_equivalence"}}


# The ~450 common tests take ~80 s on 2 cores (the overfit run alone trains 100 steps per architecture): `make test`
# runs them all; the quick run (`pytest -m "not slow"`) keeps only our own three per architecture (tests/conftest.py
# marks every other test of a module with QUICK_BY_NAME as slow).
QUICK_BY_NAME = {"test_config", "test_model", "test_causal_lm"}

SKIPPED_BY_NAME = "skipped by name: "  # the reason's prefix (the session summary counts these apart)


def _matches(test_name: str, table_name: str) -> bool:
    # parameterized.expand names its cases `<name>_<index>[_<suffix>]`
    return test_name == table_name or re.fullmatch(re.escape(table_name) + r"_\d+(_.*)?", test_name) is not None


def _lookup(table: dict[str, str], test_name: str) -> str | None:
    for name, reason in table.items():
        if _matches(test_name, name):
            return reason
    return None


# ---------------------------------------------------------------------------------------------------------------
# Model testers (the shape of transformers' Qwen3ModelTester: tiny config, random ids and padding mask)
# ---------------------------------------------------------------------------------------------------------------

_BY_TYPE = {spec["config_class"].model_type: spec for spec in ARCHS.values()}
_list_our_classes_by_name()


class LoopedModelTester:
    """Builds the tiny config and inputs that `ModelTesterMixin` asks its `model_tester` for."""

    def __init__(self, parent, arch: str, batch_size=3, seq_length=7, is_training=True):
        spec = ARCHS[arch]
        self.parent = parent
        self.arch = arch
        self.config_class = spec["config_class"]
        self.base_model_class = spec["base"]
        self.causal_lm_class = spec["causal_lm"]
        self.config_kwargs = dict(spec["config"])
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.attn_implementation = None  # None: the model's default (sdpa), as users get it
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "pad_token_id"):
            setattr(self, key, self.config_kwargs[key])

    def get_config(self):
        config = self.config_class(**self.config_kwargs)
        if self.attn_implementation is not None:
            config._attn_implementation = self.attn_implementation
        return config

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_model(self, config, input_ids, attention_mask):
        model = self.base_model_class(config).eval()
        with torch.no_grad():
            padded = model(input_ids, attention_mask=attention_mask).last_hidden_state
            plain = model(input_ids).last_hidden_state
            ones = model(input_ids, attention_mask=torch.ones_like(attention_mask)).last_hidden_state
        shape = (self.batch_size, self.seq_length, self.hidden_size)
        self.parent.assertEqual(padded.shape, shape)
        self.parent.assertEqual(plain.shape, shape)
        torch.testing.assert_close(ones, plain)  # an all-ones mask is no mask

    def create_and_check_causal_lm(self, config, input_ids, attention_mask):
        model = self.causal_lm_class(config).eval()
        with torch.no_grad():
            logits = model(input_ids, attention_mask=attention_mask).logits
            # TaH2 at M >= 2 does not materialise the mixture's logits next to a loss unless asked to
            loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
        self.parent.assertEqual(logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertTrue(torch.isfinite(logits).all())
        self.parent.assertTrue(torch.isfinite(loss))


class _LoopedCommonTests(ModelTesterMixin, TrainingTesterMixin):
    """The common tests, with this module's skip tables applied by test name."""

    arch: str = ""
    model_tester = None  # set in setUp (TrainingTesterMixin declares it abstract)
    # the overfit test's loss and grad-norm reductions (90 %) in a third of its default 300 steps: a suite-sized run
    training_overfit_steps = 100
    training_overfit_learning_rate = 3e-3

    def setUp(self):
        reason = _lookup(SKIP_ALL, self._testMethodName) or _lookup(SKIP_BY_ARCH[self.arch], self._testMethodName)
        if reason:
            self.skipTest(f"{SKIPPED_BY_NAME}{reason}")
        self.model_tester = LoopedModelTester(self, self.arch)
        if self._testMethodName in RUN_WITHOUT_ATTENTIONS.get(self.arch, ()):
            self.has_attentions = False
        elif self._testMethodName in RUN_UNDER_EAGER:
            self.model_tester.attn_implementation = "eager"
        self.config_tester = ConfigTester(self, config_class=ARCHS[self.arch]["config_class"],
                                          **{**ARCHS[self.arch]["config"], "hidden_size": 40})

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_causal_lm(self):
        self.model_tester.create_and_check_causal_lm(*self.model_tester.prepare_config_and_inputs())


def _common_test_case(arch: str) -> type:
    cls = type(f"{''.join(p.title() for p in arch.split('_'))}CommonTest", (_LoopedCommonTests, unittest.TestCase),
               {"arch": arch, "all_model_classes": (ARCHS[arch]["base"], ARCHS[arch]["causal_lm"]),
                "__module__": __name__})
    return cls


TaH2M1CommonTest = _common_test_case("tah2_m1")
TaH2M2CommonTest = _common_test_case("tah2_m2")
SpiralformerCommonTest = _common_test_case("spiralformer")
SgtCommonTest = _common_test_case("sgt")
