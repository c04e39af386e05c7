"""SGT: the paper's two-stage head selection [10, 2] and calibration of a Block Loop plan, on scripted entropy traces
(spec: shared/specs/sgt.md §4 "Discrepancy", §9), plus calibration of real tiny models through the same path."""

from __future__ import annotations

import pytest
import torch
from helpers.conversion_helpers import tiny_qwen3, tiny_tokenizer

import hf_loops  # noqa: F401
from hf_loops import SGTConfig
from hf_loops.conversion import convert_qwen3
from hf_loops.conversion.sgt import calibration_plan, effective_entropy, plan_from_entropy, select_layers
from hf_loops.training.sgt_growth import SGTGrowthScheduler

# The released config's shape: 16 layers × 16 heads. Layer 0 is the hottest (excluded); top-3 eligible: 13 > 9 > 5.
SCORES = [0.99] + [0.1 + 0.01 * l for l in range(1, 16)]
SCORES[13], SCORES[9], SCORES[5] = 0.8, 0.7, 0.6
H = 16


def first_pass(scores=SCORES):
    """(L, H) first-pass entropies: head h of layer l at scores[l] + 0.01·h (head 15 hottest)."""
    return torch.tensor([[s + 0.01 * h for h in range(H)] for s in scores])


def loop_pass(scores=SCORES):
    """(L, H) entropies of a looped head: the order among heads reverses (head 6 the hottest of heads 6..15)."""
    return torch.tensor([[s + 0.01 * (H - 1 - h) for h in range(H)] for s in scores])


def paper_config(**kw):
    return SGTConfig(num_hidden_layers=16, num_attention_heads=H, num_key_value_heads=4, head_dim=8, hidden_size=64,
                     intermediate_size=64, vocab_size=50, **kw)


def test_paper_two_stage_head_schedule_timeline():
    """[10, 2]: SELECT keeps the top 10 heads (6 decay over the window), the window's end re-ranks those 10 by their
    loop entropy and keeps 2 (8 decay over the next window); the next layer comes one window later."""
    cfg = paper_config(head_keep_schedule=[10, 2])
    sched = SGTGrowthScheduler.from_config(cfg)
    assert sched.head_keep_schedule == [10, 2] and (sched.growth_start, sched.growth_window) == (250, 250)
    first, loop = first_pass().tolist(), loop_pass().tolist()
    for t in range(1, 2001):
        sched.update_entropy([[first[l], loop[l]] for l in range(16)])
        sched.step_end(t)
    events = [(e["step"], e["event"], e.get("layer")) for e in sched.history]
    assert events == [(250, "select", 13), (500, "narrow", 13), (750, "select", 9), (1000, "narrow", 9),
                      (1250, "select", 5), (1500, "narrow", 5), (1750, "fix", None)]
    assert sched.history[0]["heads"] == list(range(6, 16))  # top 10 by first-pass entropy
    assert sched.history[1]["heads"] == [6, 7]  # the 10 re-ranked by loop entropy: 6 and 7 are now hottest
    gates = sched.gates(13, 625)  # mid second window: the 8 dropped heads at 1/2, the 6 first-stage drops at 0
    assert gates[0] == 0.0 and gates[10] == pytest.approx(0.5) and gates[6] == gates[7] == 1.0
    assert sched.plan() == [{"layer": l, "heads": [6, 7], "depth": 1} for l in (5, 9, 13)]


def test_calibration_runs_the_same_two_stages_on_a_scripted_trace():
    cfg = paper_config(head_keep_schedule=[10, 2])
    seen = []

    def measure(plan):
        seen.append(plan)
        out = first_pass()
        for entry in plan:  # looped heads report their loop entropy (what `effective_entropy` does)
            out[entry["layer"], entry["heads"]] = loop_pass()[entry["layer"], entry["heads"]]
        return out

    plan = calibration_plan(cfg, measure)["loop_plan"]
    assert seen[0] == [] and len(seen) == 2
    assert seen[1] == [{"layer": l, "heads": list(range(6, 16)), "depth": 1} for l in (5, 9, 13)]
    assert plan == [{"layer": l, "heads": [6, 7], "depth": 1} for l in (5, 9, 13)]
    # a single-stage schedule needs one measurement and keeps the first-pass top 2 (the released code's behaviour)
    one = calibration_plan(paper_config(), measure)["loop_plan"]
    assert one == plan_from_entropy(first_pass(), paper_config())
    assert [e["heads"] for e in one] == [[14, 15]] * 3


def test_effective_entropy_takes_the_last_loop_for_looped_heads():
    per_loop = torch.stack([first_pass(), loop_pass(), loop_pass() + 1.0], dim=1)  # (L, 3, H)
    out = effective_entropy(per_loop, [{"layer": 3, "heads": [0, 2], "depth": 2}])
    assert out[3, 0] == per_loop[3, 2, 0] and out[3, 2] == per_loop[3, 2, 2] and out[3, 1] == per_loop[3, 0, 1]
    assert torch.equal(out[4], per_loop[4, 0])


@pytest.mark.parametrize("direction", ["deep_to_shallow", "shallow_to_deep"])
@pytest.mark.parametrize("selection", ["highest_entropy", "lowest_entropy"])
def test_block_loop_plan_loops_the_layers_sgt_picks(direction, selection):
    """Block Loop calibration: one first-pass measurement, the same layers as SGT's plan (and as the scheduler
    reaches on constant entropies), whole blocks repeated `block_loop_depth` times."""
    kw = dict(growth_direction=direction, head_selection=selection)
    block = paper_config(loop_mode="block", block_loop_depth=2, **kw)
    calls = []
    result = calibration_plan(block, lambda plan: calls.append(plan) or first_pass())
    assert calls == [[]]
    heads_cfg = paper_config(**kw)
    sgt_layers = [e["layer"] for e in plan_from_entropy(first_pass(), heads_cfg)]
    assert result == {"block_loop_layers": sgt_layers, "block_loop_depth": 2}
    sched = SGTGrowthScheduler.from_config(heads_cfg)
    first = first_pass().tolist()
    for t in range(1, 1501):
        sched.update_entropy([[first[l], first[l]] for l in range(16)])
        sched.step_end(t)
    assert sorted(sched.selected) == sgt_layers
    if (direction, selection) == ("deep_to_shallow", "highest_entropy"):
        assert sgt_layers == [5, 9, 13]


def _calibration_model(**overrides):
    cfg = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    return convert_qwen3(tiny_qwen3(0, **cfg), "sgt", tokenizer=tiny_tokenizer(),
                         calibration=["the quick brown fox jumps over the lazy dog. " * 12],
                         growth_top_layers=2, growth_max_layers=2, **overrides)


def test_convert_with_calibration_builds_a_block_loop_model():
    model = _calibration_model(loop_mode="block", block_loop_depth=1)
    cfg = model.config
    assert cfg.loop_mode == "block" and cfg.loop_plan == []
    entropy = torch.tensor(cfg.calibration_entropy)
    assert entropy.shape == (4, 4) and len(cfg.block_loop_layers) == 2
    assert cfg.block_loop_layers == select_layers(entropy, cfg)
    slots, n = model.model._loop_slots()
    assert n == 4 + 2 and all(len(slots[l]) == 1 for l in cfg.block_loop_layers)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    with pytest.raises(ValueError, match="block_loop_layers"):
        _calibration_model(loop_mode="block", block_loop_layers=[1])


def test_convert_with_calibration_runs_a_two_stage_head_schedule():
    model = _calibration_model(heads_per_layer=1, head_keep_schedule=[3, 1])
    plan = model.config.loop_plan
    assert len(plan) == 2 and all(len(e["heads"]) == 1 and e["depth"] == 1 for e in plan)
    assert [l.loop_depth for l in model.model.layers] == [1 if i in {e["layer"] for e in plan} else 0
                                                          for i in range(4)]
