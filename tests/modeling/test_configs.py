"""Configuration checks shared by the three architectures: Literal-typed choices, load-time validation, unknown keys."""

import pytest
import torch
from helpers.common import tiny_qwen3_config
from transformers import AutoModelForCausalLM

import hf_loops  # noqa: F401  (registers the architectures)
from hf_loops import TaH2Config
from hf_loops.modeling.configuration_sgt import SGTConfig
from hf_loops.modeling.configuration_tah2 import DECIDERS, ITERATION_ATTENTION_MODES, MIXTURES
from hf_loops.modeling.loop_utils import check_known_keys, closest_name, literal_choices, literal_fields


def _small(cls, **kw):
    return cls(**{**tiny_qwen3_config().to_dict(), **kw})


def test_choices_come_from_the_literal_annotations():
    assert ITERATION_ATTENTION_MODES == ("duo", "causal", "same_iter")
    assert MIXTURES == ("stop_prob", "even", "final") and DECIDERS == ("learned", "always", "never", "exit_gate")
    assert set(literal_fields(TaH2Config)) == {"iteration_attention", "decision_mode", "mixture", "updater", "decider",
                                             "core_adapter", "exit_kv_fill"}
    assert literal_choices(SGTConfig, "loop_mode") == ("heads", "block")


@pytest.mark.parametrize("cls,field", [(TaH2Config, "mixture"), (TaH2Config, "iteration_attention"),
                                       (SGTConfig, "head_decay"), (SGTConfig, "entropy_estimator")])
def test_a_bad_choice_names_the_field_and_the_allowed_values(cls, field):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be one of \[") as err:
        _small(cls, **{field: "nope"})
    for allowed in literal_choices(cls, field):
        assert repr(allowed) in str(err.value)


@pytest.mark.parametrize("kwargs,field", [({"exit_threshold": 2.0}, "exit_threshold"),
                                          ({"max_iterations": 0}, "max_iterations"),
                                          ({"mixture": "mean"}, "mixture")])
def test_values_given_to_from_pretrained_are_validated_at_load_time(tmp_path, kwargs, field):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_small(TaH2Config)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"TaH2Config\.{field}"):
        AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)
    assert AutoModelForCausalLM.from_pretrained(tmp_path, exit_threshold=0.25).config.exit_threshold == 0.25


def test_sgt_values_given_at_load_time_are_validated(tmp_path):
    AutoModelForCausalLM.from_config(_small(SGTConfig)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"SGTConfig\.heads_per_layer must be an integer in \[1, 4\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path, heads_per_layer=9)


def test_unknown_keys_suggest_the_closest_field():
    assert closest_name("max_iteration", ["max_iterations", "exit_threshold"]) == "max_iterations"
    with pytest.raises(ValueError, match="did you mean max_iterations"):
        check_known_keys(TaH2Config, {"max_iteration": 3})
    with pytest.raises(ValueError, match="'zzz_qq'$"):
        check_known_keys(TaH2Config, {"zzz_qq": 1})
    # declared fields, Qwen3's, and a legacy spelling the config consumes: no error
    check_known_keys(TaH2Config, {"max_iterations": 3, "rope_theta": 1e6, "hidden_size": 64, "mixture": "even"})


def test_training_exports_the_public_names():
    from hf_loops.training import (
        SGTGrowthCallback,
        SGTGrowthScheduler,
        TaH2SFTConfig,
        TaH2SFTTrainer,
        compute_depth_labels,
    )

    assert TaH2SFTTrainer.__name__ == "TaH2SFTTrainer" and TaH2SFTConfig.__name__ == "TaH2SFTConfig"
    assert SGTGrowthCallback.__name__ == "SGTGrowthCallback" and SGTGrowthScheduler.__name__ == "SGTGrowthScheduler"
    assert callable(compute_depth_labels)
    import hf_loops.training as training

    with pytest.raises(AttributeError):
        training.NoSuchThing  # noqa: B018


def test_spiralformer_derives_the_depth_from_the_three_counts_and_validates_choices():
    from hf_loops import SpiralFormerConfig

    cfg = SpiralFormerConfig(num_pre_layers=1, num_loop_layers=2, num_post_layers=1)
    assert cfg.num_hidden_layers == 4 and len(cfg.layer_types) == 4
    assert SpiralFormerConfig(num_hidden_layers=8).num_loop_layers == 4  # depth given: the counts are derived
    with pytest.raises(ValueError, match=r"num_hidden_layers must equal .* = 4, got 5"):
        SpiralFormerConfig(num_hidden_layers=5, num_pre_layers=1, num_loop_layers=2, num_post_layers=1)
    with pytest.raises(ValueError, match=r"SpiralFormerConfig\.topology must be one of \['mesh', 'anchor'\]"):
        SpiralFormerConfig(topology="ring")


def test_convert_qwen3_rejects_unknown_fields_and_accepts_qwen3_overrides():
    from helpers.common import tiny_qwen3_config
    from transformers import Qwen3ForCausalLM

    from hf_loops.conversion import convert_qwen3

    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    with pytest.raises(ValueError, match="did you mean max_iterations"):
        convert_qwen3(qwen, "tah2", max_iteration=3)
    with pytest.raises(ValueError, match="did you mean num_pre_layers"):
        convert_qwen3(qwen, "spiralformer", num_pre_layer=1)
    assert convert_qwen3(qwen, "tah2", max_position_embeddings=4096).config.max_position_embeddings == 4096
