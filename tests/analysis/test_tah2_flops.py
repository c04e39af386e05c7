"""FLOPs accounting (tah2.md §7): the paper's Qwen3-1.7B column and consistency between the formulas."""

import pytest

from hf_loops import TaH2Config
from hf_loops.core.flops_tah2 import (
    decode_flops_fixed,
    decode_flops_standard,
    decode_flops_tah2,
    per_call_flops,
    training_flops_tah2,
    visible_keys_duo,
)

QWEN3_17B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)


def test_per_call_costs_reproduce_the_17b_column():
    c = per_call_flops(TaH2Config(**QWEN3_17B))
    assert round(c.backbone / 1e9, 3) == 2.819
    assert round(c.head / 1e9, 3) == 0.622
    assert c.attention_per_key / 1e9 == pytest.approx(2.29e-4, rel=2e-3)
    assert round(c.updater / 1e9, 3) == 0.042
    assert round(c.decider / 1e9, 3) == 0.050
    assert round(c.huginn_adapter / 1e9, 3) == 0.008


def test_eq16_with_depth_one_everywhere_equals_eq17():
    cfg = TaH2Config(**QWEN3_17B, max_iterations=1)
    P, N = 7, 5
    assert decode_flops_tah2(cfg, [1] * N, [1] * P) == pytest.approx(decode_flops_standard(cfg, P, N))


def test_visible_keys_hand_example():
    # prompt kept streams [1, 2]; earlier decode tokens ran depths [2, 1]; at depth 2: 1+2 + 2+1 + 2 = 8
    assert visible_keys_duo([1, 2], [2, 1], 2) == 8
    assert visible_keys_duo([1, 2], [2, 1], 1) == 2 + 2 + 1


def test_fixed_costs_about_twice_standard_and_tah2_in_between():
    cfg = TaH2Config(**QWEN3_17B, max_iterations=2)
    P, N = 100, 50
    std = decode_flops_standard(cfg, P, N)
    fixed = decode_flops_fixed(cfg, P, N, 2)
    adaptive = decode_flops_tah2(cfg, [1, 1, 1, 2] * 12 + [1, 2], [1] * P)
    assert 1.95 < fixed / std < 2.1
    assert 1.0 < adaptive / std < fixed / std


def test_training_flops_lookahead_share_and_validation():
    cfg = TaH2Config(**QWEN3_17B, max_iterations=2)
    out = training_flops_tah2(cfg, [1, 2, 1, 1, 2, 1, 1, 1])
    assert out["total"] == pytest.approx(3 * out["forward"] + out["label"])
    assert 0.1 < out["label"] / out["total"] < 0.3  # the paper reports 20–24% for the lookahead
    with pytest.raises(ValueError, match="depths"):
        decode_flops_tah2(cfg, [3], [1])


@pytest.mark.parametrize("preset, formula", [("tah2-fixed", "fixed"), ("ouro", "ouro")])
def test_the_dispatcher_prices_fixed_depth_variants_by_their_own_equation(preset, formula):
    """`decode_flops` (what evaluation and the demo call) once priced TaH2-fixed with Eqs. 14–16: a decider call per
    token and duo keys it does not have (2.68× Standard instead of Eq. 18's 2.29× on the depth-task model)."""
    from hf_loops.core import flops_tah2
    from hf_loops.modeling.configuration_tah2 import TAH2_PRESETS

    cfg = TaH2Config(**QWEN3_17B, max_iterations=3, **TAH2_PRESETS[preset])
    P, N = 9, 6
    want = {"fixed": flops_tah2.decode_flops_fixed, "ouro": flops_tah2.decode_flops_ouro}[formula](cfg, P, N, 3)
    got = flops_tah2.decode_flops(cfg, [1] * P, [3] * N)
    assert got == pytest.approx(want)
    assert got < decode_flops_tah2(cfg, [3] * N, [1] * P)  # no decider calls, fewer keys than duo
    with pytest.raises(ValueError, match="decode_depths.*depth 3"):
        flops_tah2.decode_flops(cfg, [1] * P, [3, 2, 3, 3, 3, 3])


@pytest.mark.parametrize("overrides, depths", [
    ({}, [1, 2, 1, 2]),
    ({"max_iterations": 1}, [1] * 4),
    ({"decider": "never"}, [1] * 4),
    ({"decider": "always", "iteration_attention": "same_iter", "mixture": "final", "loop_span": [1, 3]}, [2] * 4),
])
def test_the_dispatcher_keeps_eqs_14_to_16_for_adaptive_and_partial_loops(overrides, depths):
    from hf_loops.core import flops_tah2

    cfg = TaH2Config(**{**QWEN3_17B, "max_iterations": 2, **overrides})
    assert flops_tah2.decode_flops(cfg, [1, 2, 1], depths) == pytest.approx(decode_flops_tah2(cfg, depths, [1, 2, 1]))
