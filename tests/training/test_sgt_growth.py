"""SGT growth: Algorithm 1 on scripted entropies, gate decay, EMA, resume, the callback against a real model, and a
short Trainer run on the real corpus (spec: shared/specs/sgt.md §3–§5, §12.4–§12.5, §12.8)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_loops  # noqa: F401
from hf_loops import SGTConfig, SGTForCausalLM
from hf_loops.training.sgt_growth import SGTGrowthCallback, SGTGrowthScheduler, gate_value

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
TOKENIZER = ROOT.parent / "shared" / "data" / "qwen3-tokenizer"


def scripted(scores, num_heads=4, depth=3, head_bias=None):
    """One step's entropies e[l][k][h]: layer l's heads around scores[l] (head h offset by head_bias[h])."""
    bias = head_bias or [0.01 * h for h in range(num_heads)]
    return [[[s + bias[h] for h in range(num_heads)] for _ in range(depth + 1)] for s in scores]


def run(sched, entropy_at, last_step):
    """Drive the scheduler step by step (t = 1..last_step) with entropies from entropy_at(t)."""
    for t in range(1, last_step + 1):
        sched.update_entropy(entropy_at(t))
        sched.step_end(t)
    return [(e["step"], e["event"], e.get("layer"), e.get("depth")) for e in sched.history]


# layer 0 has the highest entropy (excluded); the top-3 eligible layers are 7 > 5 > 3.
SCORES = [0.99, 0.1, 0.2, 0.6, 0.3, 0.7, 0.4, 0.8]


def test_algorithm1_timeline_kmax1():
    sched = SGTGrowthScheduler(8, 4, max_loop_depth=1)
    trace = run(sched, lambda t: scripted(SCORES), 1300)
    assert trace == [(250, "select", 7, 1), (500, "select", 5, 1), (750, "select", 3, 1), (1000, "fix", None, None)]
    assert sched.phase == "fixed" and sched.selected == [7, 5, 3]  # deep to shallow, layer 0 never chosen
    # kept heads: the top-2 by entropy (head_bias makes heads 3 and 2 the highest)
    assert sched.plan() == [{"layer": l, "heads": [2, 3], "depth": 1} for l in (3, 5, 7)]
    assert sched.history[-1]["reason"] == "layer budget reached"


def test_algorithm1_deepens_before_widening_kmax3():
    sched = SGTGrowthScheduler(8, 4, max_loop_depth=3)
    trace = run(sched, lambda t: scripted(SCORES), 2700)
    assert trace == [
        (250, "select", 7, 1), (500, "deepen", 7, 2), (750, "deepen", 7, 3),
        (1000, "select", 5, 1), (1250, "deepen", 5, 2), (1500, "deepen", 5, 3),
        (1750, "select", 3, 1), (2000, "deepen", 3, 2), (2250, "deepen", 3, 3),
        (2500, "fix", None, None),
    ]
    assert [e["depth"] for e in sched.plan()] == [3, 3, 3]


def test_depth_threshold_and_early_fix():
    # t <= 500: top-3 = {2, 6, 4} → select 6. Afterwards layer 7 becomes the hottest, but it is deeper than
    # min(selected) = 6, so the next layer must be 1 (shallower); then no candidate <= 1 remains → early FIX.
    early = [0.9, 0.1, 0.8, 0.2, 0.6, 0.3, 0.7, 0.0]
    late = [0.9, 0.5, 0.1, 0.2, 0.1, 0.3, 0.7, 0.95]
    sched = SGTGrowthScheduler(8, 4, max_loop_depth=1)
    trace = run(sched, lambda t: scripted(early if t <= 250 else late), 1200)
    assert trace == [(250, "select", 6, 1), (500, "select", 1, 1), (750, "fix", None, None)]
    assert 7 not in sched.selected and 0 not in sched.selected
    assert sched.history[-1]["reason"] == "no shallower candidate in the top layers"


def test_exclusion_and_empty_top_fix():
    sched = SGTGrowthScheduler(3, 4, growth_start=3, growth_window=2, growth_exclude_layers=[0, 1, 2])
    assert run(sched, lambda t: scripted([0.5, 0.6, 0.7]), 10) == [(3, "fix", None, None)]


@pytest.mark.parametrize("decay, quarter", [("linear", 0.75), ("cosine", 0.5 * (1 + math.cos(math.pi / 4)))])
def test_gate_decay_values(decay, quarter):
    assert gate_value(250, 250, 250, decay) == 1.0
    assert gate_value(375, 250, 250, decay) == pytest.approx(0.5)
    assert gate_value(312.5, 250, 250, decay) == pytest.approx(quarter)
    assert gate_value(500, 250, 250, decay) == 0.0 and gate_value(900, 250, 250, decay) == 0.0
    assert gate_value(400, None, 250, decay) == 1.0  # kept heads
    sched = SGTGrowthScheduler(8, 4, head_decay=decay)
    run(sched, lambda t: scripted(SCORES), 375)
    assert sched.gates(7) == pytest.approx([0.5, 0.5, 1.0, 1.0])
    assert sched.any_decaying()
    assert sched.gates(7, 500) == [0.0, 0.0, 1.0, 1.0]


def test_one_ema_per_head_switches_its_input_when_the_head_loops():
    """Spec §3.1 (the reference): one EMA per head; a kept head of a looped layer feeds its last loop's entropy, every
    other head its first pass's, and the average carries on across a select or deepen (no restart at 0)."""
    sched = SGTGrowthScheduler(2, 2, max_loop_depth=2, entropy_ema=0.5, growth_exclude_layers=[])
    sched.update_entropy([[[0.4, 0.8], [0.2, 0.2], [0.0, 0.0]], [[0.6, 0.6], [float("nan"), None], [0.0, 0.0]]])
    assert sched.ema[0] == pytest.approx([0.2, 0.4]) and sched.ema[1] == pytest.approx([0.3, 0.3])  # ê initialised to 0; first pass only
    sched.update_entropy([[[0.8, 0.4], [0.2, 0.2], [0.1, 0.1]], [[float("nan"), None], [0.9, 0.9], [0.1, 0.1]]])
    assert sched.ema[0] == pytest.approx([0.5, 0.4]) and sched.ema[1] == pytest.approx([0.3, 0.3])  # NaN/None = not measured → unchanged
    sched.depth[0], sched.kept[0] = 1, [1]  # layer 0 loops once with head 1 kept
    sched.update_entropy([[[0.6, 0.6], [0.2, 0.8], [0.0, 0.0]], [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]])
    # head 0 (not kept) keeps reading the first pass; head 1 switches to loop 1 and continues from 0.4
    assert sched.ema[0] == pytest.approx([0.5 * 0.5 + 0.5 * 0.6, 0.5 * 0.4 + 0.5 * 0.8])
    sched.depth[0] = 2  # deepened: the kept head now reads loop 2, the same average continues
    sched.update_entropy([[[0.6, 0.6], [0.9, 0.9], [0.2, 0.2]], [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]])
    assert sched.ema[0] == pytest.approx([0.5 * 0.55 + 0.5 * 0.6, 0.5 * 0.6 + 0.5 * 0.2])
    assert sched.head_entropy(0) == pytest.approx([0.575, 0.4])
    assert sched.layer_scores() == pytest.approx([0.4875, 0.5 * (0.5 * 0.3 + 0.5 * 0.5) + 0.5 * 0.5])


def test_a_pre_per_head_state_loads_into_one_ema_per_head():
    """A scheduler state saved with one EMA per loop index (ema[l][k][h]) resumes from the values ranking read."""
    sched = SGTGrowthScheduler(2, 2, max_loop_depth=1, growth_exclude_layers=[])
    state = sched.state_dict()
    state["ema"] = [[[0.1, 0.2], [0.7, 0.8]], [[0.3, 0.4], [0.0, 0.0]]]
    state["depth"], state["kept"], state["selected"] = [1, 0], [[1], []], [0]
    sched.load_state_dict(state)
    assert sched.ema == [[0.1, 0.8], [0.3, 0.4]]


def reference_growth(entropy_at, last_step, *, num_layers, num_heads, start, window, top_k, max_layers, max_depth,
                     keep, beta, exclude):
    """A plain re-statement of the reference scheduler (spec §3.1, §4): per-head EMA updated right after the
    optimizer step from the structure that produced the step's entropies, then Algorithm 1; layers ranked by a
    stable descending sort over layer indices (ties: the lower layer first). Returns [(step, event, layer)]."""
    ema = [[0.0] * num_heads for _ in range(num_layers)]
    depth, kept = [0] * num_layers, [None] * num_layers
    selected, events = [], []
    phase, in_window, window_end = "vanilla", False, -1

    def top():
        means = {l: sum(ema[l]) / num_heads for l in range(num_layers) if l not in exclude}
        return [l for l, _ in sorted(means.items(), key=lambda item: item[1], reverse=True)][:top_k]

    def select(layer, t):
        nonlocal in_window, window_end
        selected.append(layer)
        kept[layer] = sorted(sorted(range(num_heads), key=lambda h: -ema[layer][h])[:keep])
        depth[layer] = 1
        in_window, window_end = True, t + window
        events.append((t, "select", layer))

    for t in range(1, last_step + 1):
        e = entropy_at(t)
        if phase != "fixed":
            for l in range(num_layers):
                for h in range(num_heads):
                    x = e[l][depth[l]][h] if kept[l] is not None and h in kept[l] else e[l][0][h]
                    ema[l][h] = beta * ema[l][h] + (1 - beta) * x
        if t < start:
            continue
        if t == start and phase == "vanilla":
            phase = "selecting"
            select(max(top()), t)
            continue
        if phase == "fixed" or (in_window and t < window_end):
            continue
        if not in_window:
            continue
        in_window = False
        best = top()
        deepened = next((l for l in selected if l in best and depth[l] < max_depth), None)
        if deepened is not None:
            depth[deepened] += 1
            in_window, window_end = True, t + window
            events.append((t, "deepen", deepened))
            continue
        candidates = [l for l in best if l not in selected and l <= min(selected)]
        if len(selected) >= max_layers or not candidates:
            phase = "fixed"
            events.append((t, "fix", None))
        else:
            select(max(candidates), t)
    return events, [{"layer": l, "heads": kept[l], "depth": depth[l]} for l in sorted(selected)]


def test_select_and_deepen_within_a_short_window_scripted():
    """A scripted trace where the looped head's EMA continuity decides: window 2, K_max 2. Layer 3 is selected at
    t = 2 (top-2 = [3, 2]); its kept head keeps its average when it switches to the loop's entropy, so at t = 4 layer 3
    is still in the top-2 (0.609 vs 0.563, 0.553) and is deepened. (A loop EMA restarted at 0 would drop layer 3 to
    0.548, below layer 1's 0.553, and select layer 2 instead.)"""
    values = [0.9, 0.59, 0.6, 0.65]

    def ent(t):
        return [[[v, v] for _ in range(3)] for v in values]

    kw = dict(growth_start=2, growth_window=2, growth_top_layers=2, growth_max_layers=2, heads_per_layer=1,
              max_loop_depth=2, entropy_ema=0.5, growth_exclude_layers=[0])
    sched = SGTGrowthScheduler(4, 2, **kw)
    trace = run(sched, ent, 12)
    assert trace == [(2, "select", 3, 1), (4, "deepen", 3, 2), (6, "select", 2, 1), (8, "deepen", 2, 2),
                     (10, "fix", None, None)]
    assert sched.layer_scores()[3] == pytest.approx(0.65 * (1 - 0.5 ** 10))  # one unbroken average
    events, plan = reference_growth(ent, 12, num_layers=4, num_heads=2, start=2, window=2, top_k=2, max_layers=2,
                                    max_depth=2, keep=1, beta=0.5, exclude=[0])
    assert [(t, kind, layer) for t, kind, layer, _ in trace] == events and sched.plan() == plan


@pytest.mark.parametrize("window, top_k, max_depth", [(3, 3, 1), (3, 2, 2), (4, 2, 1), (4, 3, 3), (2, 2, 3)])
def test_short_window_traces_match_the_reference_scheduler(window, top_k, max_depth):
    """Seeded random entropy traces (loops with their own entropies, drifting layer means): the scheduler selects,
    deepens and fixes at the same steps, with the same heads, as the re-stated reference."""
    import random

    L, H = 6, 4
    for seed in range(40):
        rng = random.Random(1000 * window + 100 * top_k + 10 * max_depth + seed)
        base = [[rng.random() for _ in range(H)] for _ in range(L)]
        drift = [rng.uniform(-0.05, 0.05) for _ in range(L)]
        loop_shift = [[rng.uniform(-0.3, 0.3) for _ in range(max_depth + 1)] for _ in range(L)]
        trace = {t: [[[min(1.0, max(0.0, base[l][h] + drift[l] * t + loop_shift[l][k] * (k > 0)
                                       + rng.gauss(0, 0.05))) for h in range(H)]
                      for k in range(max_depth + 1)] for l in range(L)] for t in range(1, 41)}
        kw = dict(growth_start=3, growth_window=window, growth_top_layers=top_k, growth_max_layers=3,
                  heads_per_layer=2, max_loop_depth=max_depth, entropy_ema=0.5, growth_exclude_layers=[0])
        sched = SGTGrowthScheduler(L, H, **kw)
        ours = run(sched, trace.__getitem__, 40)
        events, plan = reference_growth(trace.__getitem__, 40, num_layers=L, num_heads=H, start=3, window=window,
                                        top_k=top_k, max_layers=3, max_depth=max_depth, keep=2, beta=0.5,
                                        exclude=[0])
        assert [(t, kind, layer) for t, kind, layer, _ in ours] == events, seed
        assert sched.plan() == plan, seed


def test_two_stage_head_schedule():
    sched = SGTGrowthScheduler(4, 8, heads_per_layer=2, head_keep_schedule=[4, 2], growth_exclude_layers=[0])
    bias = [0.01 * h for h in range(8)]

    def ent(t):
        e = scripted([0.1, 0.2, 0.3, 0.8], 8, 1, bias)
        if t > 250:  # after selection the looped heads' own entropy reorders them: head 4 is now the highest
            e[3][1] = [0.8, 0.8, 0.8, 0.8, 0.95, 0.7, 0.9, 0.6]
        return e

    trace = run(sched, ent, 800)
    assert trace[:3] == [(250, "select", 3, 1), (500, "narrow", 3, None), (750, "select", 2, 1)]
    assert sched.history[0]["heads"] == [4, 5, 6, 7]
    assert sched.history[1]["heads"] == [4, 6]
    g = sched.gates(3, 625)
    assert g[0] == 0.0 and g[5] == pytest.approx(0.5) and g[7] == pytest.approx(0.5) and g[4] == g[6] == 1.0


def test_resume_mid_window_reproduces_the_trace():
    ent = lambda t: scripted([v + 0.001 * math.sin(t + l) for l, v in enumerate(SCORES)])  # noqa: E731
    full = SGTGrowthScheduler(8, 4)
    ref = run(full, ent, 1100)
    first = SGTGrowthScheduler(8, 4)
    run(first, ent, 600)  # mid-window (selection at 500, window ends at 750)
    state = json.loads(json.dumps(first.state_dict()))
    second = SGTGrowthScheduler(8, 4)
    second.load_state_dict(state)
    for t in range(601, 1101):
        second.update_entropy(ent(t))
        second.step_end(t)
    assert [(e["step"], e["event"], e.get("layer")) for e in second.history] == [r[:3] for r in ref]
    assert second.state_dict() == full.state_dict()


# ---------------------------------------------------------------------------------------------------------------------
# callback against a real model
# ---------------------------------------------------------------------------------------------------------------------


def tiny_model(**growth):
    torch.manual_seed(0)
    cfg = SGTConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, growth_start=2, growth_window=4,
                    **growth)
    return SGTForCausalLM(cfg)


def test_callback_drives_the_model_and_freezes_a_plan(tmp_path):
    model = tiny_model()
    cb = SGTGrowthCallback(seq_len=16)
    cb.setup(model)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = {}
    for t in range(1, 16):
        model.train()
        model(x, labels=x).loss.backward()  # entropy statistics accumulate in the training forward
        cb.step_end(t, model)
        seen[t] = (model.model.loop_structure(), [l.head_gate.tolist() for l in model.model.layers])
    events = [(e["step"], e["event"], e.get("layer")) for e in cb.scheduler.history]
    assert events == [(2, "select", 3), (6, "select", 2), (10, "select", 1), (14, "fix", None)]
    # at selection all heads loop (g = 1); mid-window the non-kept heads run with g = 0.5; after the window 2 heads
    kept3 = cb.scheduler.kept[3]
    assert seen[2][0] == [{"layer": 3, "heads": [0, 1, 2, 3], "depth": 1}]
    assert sorted(g for g in seen[4][1][3]) == [0.5, 0.5, 1.0, 1.0]
    assert seen[6][0][-1] == {"layer": 3, "heads": kept3, "depth": 1}
    plan = cb.scheduler.plan()
    assert model.config.loop_plan == plan and [e["layer"] for e in plan] == [1, 2, 3]
    assert not any(layer.collect_entropy for layer in model.model.layers)  # fixed phase: no statistics
    assert model.model.loop_structure() == plan
    metrics = cb.metrics()
    assert metrics["sgt/phase"] == "fixed" and json.loads(metrics["sgt/selected_layers"]) == [3, 2, 1]
    # save after growth → AutoModelForCausalLM builds the static sliced graph from the plan alone
    model.eval()
    with torch.no_grad():
        before = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.loop_structure() == plan
    assert not any(l.loop_gated for l in loaded.model.layers)
    with torch.no_grad():
        assert (loaded(x).logits - before).abs().max().item() <= 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# a short Trainer run on the real corpus (examples/train_sgt.py)
# ---------------------------------------------------------------------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location("train_sgt_example", ROOT / "examples" / "train_sgt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not CORPUS.is_dir() or not TOKENIZER.is_dir(), reason="shared/data not available")
@pytest.mark.slow
def test_trainer_run_grows_on_schedule_and_resumes(tmp_path):
    example = _example()
    common = ["--corpus-dir", str(CORPUS), "--tokenizer", str(TOKENIZER), "--compact-vocab", "--max-chars", "20000",
              "--seq-len", "32", "--batch-size", "4", "--hidden-size", "32", "--max-steps", "24",
              "--growth-start", "5", "--growth-window", "5", "--logging-steps", "100"]
    out_a = tmp_path / "a"
    trainer, cb = example.main(common + ["--output-dir", str(out_a), "--save-steps", "12"])
    trace = [(e["step"], e["event"], e.get("layer")) for e in cb.scheduler.history]
    assert trace == [(5, "select", 3), (10, "select", 2), (15, "select", 1), (20, "fix", None)]
    # the structure changes are logged at the steps they happen
    logged = {h["step"]: h for h in trainer.state.log_history if "sgt/phase" in h}
    assert logged[5]["sgt/selected_layers"] == "[3]" and logged[10]["sgt/selected_layers"] == "[3, 2]"
    assert {5, 10, 15, 20} <= set(logged)  # a log line at every structure change (logging_steps is 100)
    assert logged[5]["sgt/phase"] == "selecting" and logged[20]["sgt/phase"] == "fixed"
    assert "sgt/entropy/layer_0" in logged[20] and json.loads(logged[20]["sgt/loop_depths"]) == {"3": 1, "2": 1,
                                                                                                 "1": 1}
    assert 0 < logged[20]["sgt/flops_overhead"] < logged[15]["sgt/flops_overhead"]  # window over: 2 heads, not 4
    plan = cb.scheduler.plan()
    saved = json.loads((out_a / "final" / "config.json").read_text())
    assert saved["loop_plan"] == plan
    # the final checkpoint reloads as a static graph with the same logits
    model = trainer.model.eval()
    x = torch.arange(20)[None]
    with torch.no_grad():
        before = model(x).logits
        after = AutoModelForCausalLM.from_pretrained(out_a / "final").eval()(x).logits
    assert (after - before).abs().max().item() <= 1e-6
    # resume from the mid-window checkpoint (step 12: layer 2 selected at 10, its window ends at 15)
    ckpt = out_a / "checkpoint-12"
    state = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["SGTGrowthCallback"]
    assert state["attributes"]["scheduler_state"]["selected"] == [3, 2]
    trainer_b, cb_b = example.main(common + ["--output-dir", str(tmp_path / "b"), "--resume", str(ckpt)])
    assert cb_b is not cb
    assert [(e["step"], e["event"], e.get("layer")) for e in cb_b.scheduler.history] == trace
    assert [e["layer"] for e in cb_b.scheduler.plan()] == [e["layer"] for e in plan]
    assert trainer_b.model.config.loop_plan == cb_b.scheduler.plan()


_RANK_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
rank, pg = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + pg, rank=rank, world_size=2)
from hf_loops import SGTConfig, SGTForCausalLM
from hf_loops.training.sgt_growth import SGTGrowthCallback
torch.manual_seed(0)
cfg = SGTConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, growth_start=2, growth_window=4)
model = SGTForCausalLM(cfg).train()
cb = SGTGrowthCallback()
cb.setup(model)
model(torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(rank)))
cb.step_end(1, model)
print("EMA", json.dumps(cb.scheduler.ema))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_rank_all_reduce_equals_one_process(tmp_path):
    """Rank r sees micro-batch r; after all_reduce both ranks hold the EMA one process gets from both micro-batches.
    This process is rank 0 (its imports are warm), a subprocess is rank 1."""
    import datetime
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), "1", str(tmp_path / "pg")], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # one-process reference: both micro-batches in one step, no process group
        model = tiny_model().train()
        cb = SGTGrowthCallback()
        cb.setup(model)
        for r in (0, 1):
            model(torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(r)))
        cb.step_end(1, model)
        ref = torch.tensor(cb.scheduler.ema)
        assert ref[:, 0].abs().sum() > 0
        # rank 0 of a 2-rank gloo group
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        try:
            model = tiny_model().train()
            cb = SGTGrowthCallback()
            cb.setup(model)
            model(torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0)))
            cb.step_end(1, model)
            rank0 = torch.tensor(cb.scheduler.ema)
        finally:
            dist.destroy_process_group()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-2000:]
    rank1 = torch.tensor(json.loads(next(ln for ln in out.splitlines() if ln.startswith("EMA"))[4:]))
    assert torch.allclose(rank0, ref, atol=1e-6) and torch.allclose(rank1, ref, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# The paper's ablations and one selection rule for growth and calibration
# ----------------------------------------------------------------------------------------------------------------------


def test_shallow_to_deep_growth_adds_layers_upwards():
    sched = SGTGrowthScheduler(8, 4, max_loop_depth=1, growth_direction="shallow_to_deep")
    trace = run(sched, lambda t: scripted(SCORES), 1300)
    assert trace == [(250, "select", 3, 1), (500, "select", 5, 1), (750, "select", 7, 1), (1000, "fix", None, None)]


def test_lowest_entropy_selection_loops_the_coldest_layers_and_heads():
    sched = SGTGrowthScheduler(8, 4, max_loop_depth=1, head_selection="lowest_entropy")
    run(sched, lambda t: scripted(SCORES), 1300)
    # coldest eligible layers: 1 (0.1) < 2 (0.2) < 4 (0.3); deep to shallow: 4, 2, 1; heads 0 and 1 are the coldest
    assert sched.selected == [4, 2, 1]
    assert sched.plan() == [{"layer": l, "heads": [0, 1], "depth": 1} for l in (1, 2, 4)]


def test_config_carries_the_ablation_knobs_into_the_scheduler():
    cfg = SGTConfig(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
                    intermediate_size=64, vocab_size=50, growth_direction="shallow_to_deep",
                    head_selection="lowest_entropy")
    sched = SGTGrowthScheduler.from_config(cfg)
    assert (sched.growth_direction, sched.head_selection) == ("shallow_to_deep", "lowest_entropy")
    with pytest.raises(ValueError, match=r"SGTConfig\.growth_direction must be one of"):
        SGTConfig(growth_direction="sideways")


@pytest.mark.parametrize("direction", ["deep_to_shallow", "shallow_to_deep"])
@pytest.mark.parametrize("selection", ["highest_entropy", "lowest_entropy"])
def test_calibration_plan_equals_the_scheduler_on_constant_entropies(direction, selection):
    """With entropies that never change, growth ends where calibration starts: same layers, heads, depth — ties
    included: layers 3 and 5 tie for the last top-3 place, and the lower one (3) gets it in both (the reference's
    stable sort over layers in index order)."""
    from hf_loops.conversion.sgt import plan_from_entropy

    scores = [0.99, 0.1, 0.2, 0.5, 0.3, 0.5, 0.7, 0.8]
    cfg = SGTConfig(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
                    intermediate_size=64, vocab_size=50, max_loop_depth=2, growth_direction=direction,
                    head_selection=selection)
    sched = SGTGrowthScheduler.from_config(cfg)
    run(sched, lambda t: scripted(scores, depth=2), 3000)
    entropy = torch.tensor([step[0] for step in scripted(scores, depth=2)])
    assert plan_from_entropy(entropy, cfg) == sched.plan()
    if selection == "highest_entropy":
        assert 3 in sched.selected and 5 not in sched.selected
