"""`hf-loops reproduce sgt`: does looping a few high-entropy heads give Block Loop's gain at a sliver of its cost?

The paper's claims (SGT): growing head-level attention loops (Algorithm 1: the highest-entropy heads of the deepest
high-entropy layers, deep to shallow) recovers most of Block Loop's gain over the vanilla model at 1–3 % extra
training FLOPs, where Block Loop (whole blocks re-applied) costs 16–20 %.

What runs: vanilla (an SGT with no loops = Qwen3), Block Loop (layer 4 of 6 applied twice: 1/6 extra) and SGT (growth
from step `growth_start` with `SGTGrowthCallback` driven step by step, then the frozen plan), 6 layers of width 128,
from the same seeds on the same token blocks of the shipped Shakespeare slice as `hf-loops reproduce spiralformer`
(`hf_loops.reproduce.common`). Every run reports its held-out test loss, validation curve and training FLOPs ÷ vanilla
(`hf_loops.core.flops_sgt`: Block Loop's static overhead; SGT's mean per-step overhead over the run, decaying heads
included), and SGT runs where growth put the loops (layer × head).

Writes OUT/summary.json, OUT/report.md, OUT/runs.json, OUT/loss_curves.png, OUT/loop_plan.png and OUT/ARCH-seed0/.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from .common import load_data, mean_loss, plot_validation_curves, pm, train_lm

ARCHS = ("vanilla", "block", "sgt")
LABELS = {"vanilla": "vanilla (6 layers)", "block": "Block Loop (layer 4 twice)", "sgt": "SGT (grown head loops)"}
SEEDS = (0, 1, 2)
MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_hidden_layers": 6, "block_loop_layers": [4], "block_loop_depth": 1,
         # growth scaled to 200 steps: select at 50, one window of 25 steps per decision, 3 layers, 2 heads each
         "growth_start": 50, "growth_window": 25, "growth_top_layers": 3, "growth_max_layers": 3,
         "heads_per_layer": 2, "max_loop_depth": 1}
TRAINING = {"seq_len": 512, "batch_size": 4, "steps": 200, "lr": 3e-3, "warmup_steps": 10, "min_lr_rate": 0.1,
            "beta2": 0.95, "weight_decay": 0.01, "grad_clip": 1.0, "eval_every": 50}
QUICK_MODEL = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3, "block_loop_layers": [1],
               "growth_start": 2, "growth_window": 2, "growth_top_layers": 2, "growth_max_layers": 1}
QUICK = {**TRAINING, "seq_len": 64, "batch_size": 2, "steps": 8, "eval_every": 8, "max_chars": 60_000}


@dataclass(frozen=True)
class SGTJob:
    """One (arch, seed) run; plain fields, so it travels to a spawned worker."""

    arch: str
    seed: int
    model: dict
    training: dict
    out: str
    keep: bool = False
    threads: int = 1
    settings: dict = field(default_factory=dict)  # `run_jobs`' cost estimate (max_steps, max_length)


def build_sgt_model(arch: str, vocab_size: int, model: dict, seq_len: int, pad_token_id: int):
    from ..modeling.configuration_sgt import SGTConfig
    from ..modeling.modeling_sgt import SGTForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    fields = dict(model)
    if arch == "block":
        fields["loop_mode"] = "block"
    else:
        fields["block_loop_layers"] = []
    return SGTForCausalLM(SGTConfig(**fields, vocab_size=vocab_size, max_position_embeddings=seq_len,
                                    tie_word_embeddings=True, pad_token_id=pad_token_id))


def run_sgt_one(job: SGTJob) -> dict:
    """Train one arch from `job.seed` (SGT: growing), evaluate it; returns its FIELDS and curve."""
    import torch

    from ..core.flops_sgt import plan_overhead, training_overhead
    from ..training.sgt_growth import SGTGrowthCallback

    t0 = time.perf_counter()
    t = job.training
    tok, train, val, test = load_data(t, job.threads)
    torch.manual_seed(job.seed)
    model = build_sgt_model(job.arch, len(tok), job.model, t["seq_len"], tok.pad_token_id)
    overheads, events, on_step = [], [], None
    if job.arch == "sgt":
        growth = SGTGrowthCallback(seq_len=t["seq_len"])
        growth.setup(model)

        def on_step(step, m):
            events.extend(growth.step_end(step, m))
            overheads.append(growth.current_overhead(t["seq_len"]))

    curve = train_lm(model, train, val, t, job.seed, on_step)
    if job.arch == "sgt":
        overhead = training_overhead(overheads)
        if growth.scheduler.phase != "fixed":
            raise RuntimeError(f"SGT growth did not finish in {t['steps']} steps (phase {growth.scheduler.phase})")
    elif job.arch == "block":
        overhead = plan_overhead(model.config, t["seq_len"])
    else:
        overhead = 0.0
    fields = {"test_loss": mean_loss(model, test, 8), "validation_loss": curve[-1]["validation_loss"],
              "training_flops_ratio": 1.0 + overhead, "parameters": sum(p.numel() for p in model.parameters()),
              "train_seconds": time.perf_counter() - t0, "tokens": t["steps"] * t["batch_size"] * t["seq_len"]}
    if job.arch == "sgt":
        fields["loop_plan"] = model.config.loop_plan
        fields["final_flops_ratio"] = 1.0 + plan_overhead(model.config, t["seq_len"])
        fields["growth_events"] = [e for e in events if e.get("event") in ("select", "deepen", "narrow", "fix")]
    if job.keep:
        model.save_pretrained(job.out)
        tok.save_pretrained(job.out)
    print(f"[reproduce] sgt seed {job.seed}: {job.arch} done ({time.perf_counter() - t0:.0f} s, test loss "
          f"{fields['test_loss']:.3f})", flush=True)
    return {"fields": fields, "curve": curve}


def sgt_claims(archs: dict) -> list[tuple[str, bool, str]]:
    """The paper's claim on the measured numbers: (name, held, the numbers)."""
    v, b, s = (archs[a]["seeds"] for a in ARCHS)
    seeds = sorted(v, key=int)
    gain_b = statistics.fmean(v[k]["test_loss"] - b[k]["test_loss"] for k in seeds)
    gain_s = statistics.fmean(v[k]["test_loss"] - s[k]["test_loss"] for k in seeds)
    x_s = statistics.fmean(s[k]["training_flops_ratio"] for k in seeds) - 1
    x_b = statistics.fmean(b[k]["training_flops_ratio"] for k in seeds) - 1
    share = gain_s / gain_b if gain_b > 0 else float("nan")
    return [("SGT gets ≥ 50 % of Block Loop's loss gain over vanilla at ≤ 5 % extra training FLOPs",
             gain_b > 0 and gain_s >= 0.5 * gain_b and x_s <= 0.05,
             f"loss gain over vanilla: Block Loop {gain_b:+.4f}, SGT {gain_s:+.4f} nats/token"
             + (f" ({100 * share:.0f} % of Block Loop's)" if gain_b > 0 else " (Block Loop gains nothing)")
             + f"; extra training FLOPs: SGT {100 * x_s:.1f} %, Block Loop {100 * x_b:.1f} %")]


def sgt_aggregate(runs: dict) -> dict:
    archs = {}
    for (arch, seed), r in runs.items():
        archs.setdefault(arch, {"seeds": {}})["seeds"][str(seed)] = r["fields"]
    return archs


def sgt_table(archs: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "parameters", "held-out loss (nats/token)", "per seed", "validation loss",
               "training FLOPs ÷ vanilla", "training time (s)"]
    rows = []
    for arch in ARCHS:
        fs = [archs[arch]["seeds"][k] for k in sorted(archs[arch]["seeds"], key=int)]
        rows.append([LABELS[arch], f"{fs[0]['parameters']:,}", pm([f["test_loss"] for f in fs], ".4f"),
                     " / ".join(f"{f['test_loss']:.4f}" for f in fs), pm([f["validation_loss"] for f in fs], ".4f"),
                     pm([f["training_flops_ratio"] for f in fs], ".4f") + "×",
                     pm([f["train_seconds"] for f in fs], ".0f")])
    return headers, rows


def plan_rows(archs: dict) -> tuple[list[str], list[list[str]]]:
    """Where growth put the loops: per seed, the looped layers (deepest first) with their kept heads."""
    rows = []
    for k in sorted(archs["sgt"]["seeds"], key=int):
        plan = archs["sgt"]["seeds"][k]["loop_plan"] or []
        rows.append([k, "; ".join(f"layer {e['layer']}: heads {e['heads']}, depth {e['depth']}" for e in plan) or "–",
                     f"{archs['sgt']['seeds'][k]['final_flops_ratio']:.4f}×"])
    return ["seed", "loop plan at the end of growth", "forward FLOPs ÷ vanilla (frozen plan)"], rows


def _plots(archs: dict, runs: dict, model: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"vanilla": "#8fa3bf", "block": "#4c956c", "sgt": "#c44e12"}
    plot_validation_curves(runs, LABELS, colors, os.path.join(out, "loss_curves.png"))
    seeds = sorted(archs["sgt"]["seeds"], key=int)
    L, H = model["num_hidden_layers"], model["num_attention_heads"]
    fig, axes = plt.subplots(1, len(seeds), figsize=(2.2 * len(seeds) + 1, 3), dpi=110, squeeze=False)
    for ax, k in zip(axes[0], seeds, strict=True):
        grid = np.zeros((L, H))
        for e in archs["sgt"]["seeds"][k]["loop_plan"] or []:
            grid[e["layer"], e["heads"]] = e["depth"]
        ax.imshow(grid, cmap="Oranges", vmin=0, vmax=max(1, grid.max()), origin="lower", aspect="auto")
        ax.set_title(f"seed {k}", fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
    axes[0][0].set_ylabel("layer")
    fig.suptitle("SGT: looped heads (orange) after growth", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loop_plan.png"))
    plt.close(fig)


def run_sgt(out: str, seeds=SEEDS, quick: bool = False, overwrite: bool = False, workers: int | None = None,
            steps: int | None = None, lr: float | None = None) -> dict:
    """Every arch × seed, then summary.json, report.md, runs.json, pictures and the first seed's checkpoints."""
    from ..evaluation.report import markdown_table
    from .common import check_run_settings, run_reproduction, write_report, write_summary

    seeds, training = check_run_settings(seeds, QUICK if quick else TRAINING, steps, lr)
    model = QUICK_MODEL if quick else MODEL
    t_start = time.perf_counter()

    def make_jobs(tmp):
        return [SGTJob(arch, seed, model, training, os.path.join(tmp, f"{arch}-seed{seed}"), keep=seed == seeds[0],
                        settings={"max_steps": training["steps"], "max_length": training["seq_len"]})
                for seed in seeds for arch in ARCHS]

    def write(tmp, runs):
        archs = sgt_aggregate(runs)
        verdicts = sgt_claims(archs)
        summary = {"claims": [{"claim": n, "held": ok, "numbers": t} for n, ok, t in verdicts], "archs": archs}
        write_summary(tmp, summary, runs, model, training, seeds)
        _plots(archs, runs, model, tmp)
        seconds = time.perf_counter() - t_start
        write_report(tmp, "sgt", quick, seeds, len(ARCHS), training, model, seconds, markdown_table(*sgt_table(archs)),
                     verdicts, [
            "## Where growth put the loops",
            "",
            markdown_table(*plan_rows(archs)),
            "",
            "![validation loss](loss_curves.png)",
            "",
            "![loop plan](loop_plan.png)",
            "",
        ])
        return {"summary": summary, "tables": [sgt_table(archs), plan_rows(archs)], "claims": verdicts,
                "files": "summary.json, report.md, runs.json, loss_curves.png, loop_plan.png"}

    res = run_reproduction(out, overwrite, make_jobs, run_sgt_one, workers, write)
    return {**res, "seconds": time.perf_counter() - t_start}


__all__ = ["ARCHS", "MODEL", "QUICK", "TRAINING", "build_sgt_model", "plan_rows", "run_sgt", "run_sgt_one",
           "sgt_aggregate", "sgt_claims", "sgt_table"]
