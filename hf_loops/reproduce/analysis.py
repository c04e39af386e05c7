"""`hf-loops reproduce analysis`: do the looped models trained here converge to cyclic fixed points, and do their
attention stages repeat per recurrence?

The paper's claims (A Mechanistic Analysis of Looped Reasoning Language Models, arXiv 2604.11791): each layer of a
looped block converges to its own fixed point (almost every token: 0.02–0.14 % of GSM8K tokens do not), so the block
follows a cycle in latent space; the per-layer fixed points are distinct (cyclic) rather than one shared
(degenerate) point; as the fixed points are reached attention behaviour stabilises, within 1–2 recurrences, and stays
constant at recurrence counts never trained; and the block repeats its stages of inference with every recurrence.

What runs, three seeds each, with the recipes of the other reproductions (so these are the looped models those runs
train, from the same seeds on the same data):
- LoopedFormer {1, 1} with the anchor topology (input injection h(t+1) = h(0) + core(h(t))): the SpiralFormer run's
  LoopedFormer with one change, since the MeSH topology that run uses has one router per trained iteration and cannot
  run 128 recurrences; on the shipped Shakespeare slice.
- Block Loop (layer 4 of 6 run twice, no input injection): the SGT run's; the same slice.
- TaH2 (M = 2, top-k updater) post-trained on the depth-bound hop task from the embedded base: the demo's recipe; it
  is probed on held-out hop problems (prompt and answer), every token forced through every depth.

Probes (`hf_loops.analysis`, the paper's definitions and thresholds): T_fp = 128 recurrences, X* = the last; the
limiting-behaviour classification of every token of the last loop layer (fixed point: 1 − cos(x_t, x*) < τ = 0.05 for
≥ ρ = 0.9 of the last half); the degenerate score min_ℓ cos(X*_1, X*_ℓ) (> 0.95: one shared point, our threshold);
beside it, the relative distance ‖X*_1 − X*_ℓ‖ / ‖X*_1‖ between the layers' fixed points and the last step's relative
motion ‖X_T − X_(T−1)‖ / ‖X_(T−1)‖ (how far apart the points are, against how still each is); and, over 32
recurrences (the paper's extended count), three stage metrics per realised loop step: key-marginal
concentration (1 − H_km / log keys; ColSum concentration for square attention), sink rate (sink score ≥ 0.3) and the
normalised mixing score. Stages repeat when every loop step after the first recurrence is nearest, in stage-metric
space, to the same layer at another recurrence (≥ 90 % of steps, our threshold); attention is stable from the first
recurrence after which every stage metric stays within 0.02 of its value at recurrence 32 (our threshold).

Writes OUT/summary.json (`{"claims": ..., "archs": {ARCH: {"seeds": {SEED: FIELDS}}}}`), OUT/report.md, OUT/runs.json,
OUT/fixed_points.png, OUT/stages.png and OUT/ARCH-seed0/ (the first seed's checkpoints).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

from .common import load_data, mean_loss, pm, train_lm

ARCHS = ("looped-anchor", "block", "tah2")
LABELS = {"looped-anchor": "LoopedFormer {1,1}, anchor", "block": "Block Loop (layer 4 twice)",
          "tah2": "TaH2 (hop task)"}
SEEDS = (0, 1, 2)
TAU, RHO = 0.05, 0.9  # the paper's limiting-behaviour thresholds
SINK_TAU = 0.3  # the paper's sink-score threshold
FIXED_SHARE = 0.99  # "almost every token": the paper measures 99.86–99.98 %
DEGENERATE = 0.95  # [D] min_ℓ cos(X*_1, X*_ℓ) above this: one shared (degenerate) fixed point
REPEAT_SHARE = 0.9  # [D] stages repeat: this share of loop steps nearest to their own layer
STABLE_TOL, STABLE_BY = 0.02, 3  # [D] stage metrics within 0.02 of recurrence R from recurrence 3 ("1–2 recurrences")
STAGE_METRICS = ("concentration", "sink_rate", "mixing")
PROBES = {"fixed_point_recurrences": 128, "stage_recurrences": 32, "texts": 8, "tokens": 256}
QUICK_PROBES = {"fixed_point_recurrences": 12, "stage_recurrences": 4, "texts": 2, "tokens": 24}


@dataclass(frozen=True)
class AnalysisJob:
    """One (arch, seed) run; plain fields, so it travels to a spawned worker. `hop` is the demo's RunJob (TaH2)."""

    arch: str
    seed: int
    out: str
    model: dict
    training: dict
    probes: dict
    keep: bool = False
    threads: int = 1
    hop: object = None
    settings: dict = field(default_factory=dict)  # `run_jobs`' cost estimate (max_steps, max_length)


# ----------------------------------------------------------------------------------------------------------------------
# The probes
# ----------------------------------------------------------------------------------------------------------------------


def stage_repeat_share(rows: list[dict], first: int = 2) -> float | None:
    """Share of loop steps (recurrence ≥ `first`) whose nearest other step in stage-metric space (Euclidean over
    `STAGE_METRICS`) belongs to the same layer; None with one loop layer (nothing to tell apart)."""
    pts = [r for r in rows if r["recurrence"] >= first]
    if len({r["layer"] for r in pts}) < 2:
        return None
    same = 0
    for i, a in enumerate(pts):
        d = [(math.dist([a[k] for k in STAGE_METRICS], [b[k] for k in STAGE_METRICS]), b["layer"])
             for j, b in enumerate(pts) if j != i]
        same += min(d)[1] == a["layer"]
    return same / len(pts)


def stable_from(rows: list[dict], tol: float = STABLE_TOL) -> int:
    """The first recurrence t after which every layer's stage metrics stay within `tol` of their values at the last
    recurrence R (R itself at worst)."""
    last = max(r["recurrence"] for r in rows)
    ref = {r["layer"]: r for r in rows if r["recurrence"] == last}
    off = [r["recurrence"] for r in rows if any(abs(r[k] - ref[r["layer"]][k]) > tol for k in STAGE_METRICS)]
    return max(off, default=0) + 1


def _stage_rows(model, sequences, recurrences: int) -> list[dict]:
    """Stage metrics per realised loop step, each the mean over heads, then over `sequences`."""
    import torch

    from ..analysis import attention_metrics as am
    from ..analysis.trace import capture_trace

    sums: dict[tuple[int, int], list[float]] = {}
    for ids in sequences:
        trace = capture_trace(model, torch.tensor([ids]), num_recurrences=recurrences, record=("attention",),
                              max_length=len(ids))
        for s in trace.loop_steps():
            A, m = s.attention.weights(), s.attention.masks()
            v = [1.0 - float(am.key_marginal_entropy(A, normalized=True, **m).mean()),
                 float(am.sink_rate(A, SINK_TAU, **m)), float(am.mixing_score(A, normalized=True, **m).mean())]
            acc = sums.setdefault((s.layer, s.recurrence), [0.0] * len(v))
            sums[s.layer, s.recurrence] = [a + b / len(sequences) for a, b in zip(acc, v, strict=True)]
    return [{"layer": ell, "recurrence": t, **dict(zip(STAGE_METRICS, v, strict=True))}
            for (ell, t), v in sorted(sums.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def _fixed_points(model, sequences, recurrences: int) -> dict:
    """Limiting behaviour of the last loop layer's tokens, the degenerate score and cos(X_t, X*) per loop layer."""
    import torch

    from ..analysis import residual_metrics as rm
    from ..analysis.trace import capture_trace

    counts = {"fixed_point": 0, "orbit": 0, "slider": 0, "unknown": 0}
    scores, separation, motion, cosine = [], [], [], {}
    for ids in sequences:
        trace = capture_trace(model, torch.tensor([ids]), num_recurrences=recurrences, record=("residual",))
        for k, v in rm.classify_limiting_behaviour_trace(trace, TAU, RHO)["counts"].items():
            counts[k] += v
        scores.append(rm.degenerate_fixed_point_score_trace(trace))
        separation.append(rm.fixed_point_separation_trace(trace))
        motion.append(max(float(d[-1]) for d in rm.successive_difference_trace(trace, "relative").values()))
        for ell, d in rm.fixed_point_distance_trace(trace).items():
            cosine.setdefault(str(ell), []).append(d["cosine"])
    total = max(sum(counts.values()), 1)
    score = statistics.fmean(scores) if not any(math.isnan(s) for s in scores) else None
    return {"fractions": {k: v / total for k, v in counts.items()}, "tokens": total, "degenerate_score": score,
            "separation": statistics.fmean(separation) if score is not None else None,
            "final_motion": statistics.fmean(motion),
            "cosine": {ell: torch.stack(c).mean(0).tolist() for ell, c in cosine.items()}}


def probe(model, sequences: list[list[int]], probes: dict) -> dict:
    """Every probe of this reproduction on `model` over `sequences` (token id lists); the FIELDS it reports."""
    fp = _fixed_points(model, sequences, probes["fixed_point_recurrences"])
    stages = _stage_rows(model, sequences, probes["stage_recurrences"])
    return {"fixed_point_share": fp["fractions"]["fixed_point"], "limiting_behaviour": fp["fractions"],
            "tokens_probed": fp["tokens"], "degenerate_score": fp["degenerate_score"],
            "fixed_point_separation": fp["separation"], "final_motion": fp["final_motion"],
            "fixed_point_cosine": fp["cosine"], "stages": stages, "stage_repeat_share": stage_repeat_share(stages),
            "stable_from": stable_from(stages), "loop_layers": len({r["layer"] for r in stages})}


# ----------------------------------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------------------------------


def _train_corpus_model(job: AnalysisJob):
    """The corpus-trained looped model of `job` and its fields, held-out blocks for the probes and the tokenizer."""
    import torch

    from .sgt import build_sgt_model
    from .spiralformer import build_spiral_model

    t = job.training
    tok, train, val, test = load_data(t, job.threads)
    torch.manual_seed(job.seed)
    if job.arch == "looped-anchor":
        model = build_spiral_model("looped", len(tok), job.model, t["seq_len"], tok.pad_token_id, topology="anchor")
    else:
        model = build_sgt_model("block", len(tok), job.model, t["seq_len"], tok.pad_token_id)
    curve = train_lm(model, train, val, t, job.seed)
    fields = {"test_loss": mean_loss(model, test, 8), "validation_loss": curve[-1]["validation_loss"]}
    sequences = [row[: job.probes["tokens"]].tolist() for row in test[: job.probes["texts"]]]
    return model, tok, fields, sequences, curve


def _train_hop_tah2(job: AnalysisJob):
    """The demo's TaH2 (post-trained and scored by the demo's own runner), its fields and held-out hop problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..demo.runs import run_job

    r = run_job(job.hop)
    model = AutoModelForCausalLM.from_pretrained(job.hop.ckpt).eval()
    tok = AutoTokenizer.from_pretrained(job.hop.ckpt)
    run = job.hop.task_run
    examples = run.examples(run.rows()[: job.probes["texts"]])
    sequences = [tok(tok.apply_chat_template(e.prompt + e.completion, tokenize=False),
                     add_special_tokens=False)["input_ids"] for e in examples]
    return model, tok, {"exact_match": r["summary"]["exact_match"], "mean_depth": r["summary"]["mean_depth"]}, \
        sequences, []


def run_analysis_one(job: AnalysisJob) -> dict:
    """Train one looped model from `job.seed` and probe it; returns its FIELDS and validation curve."""
    t0 = time.perf_counter()
    train = _train_hop_tah2 if job.arch == "tah2" else _train_corpus_model
    model, tok, fields, sequences, curve = train(job)
    train_s = time.perf_counter() - t0
    fields.update(parameters=sum(p.numel() for p in model.parameters()), train_seconds=train_s,
                  **probe(model, sequences, job.probes), probe_seconds=time.perf_counter() - t0 - train_s)
    if job.keep and job.arch != "tah2":  # the TaH2 checkpoint is already at job.out
        model.save_pretrained(job.out)
        tok.save_pretrained(job.out)
    print(f"[reproduce] analysis seed {job.seed}: {job.arch} done ({time.perf_counter() - t0:.0f} s, fixed points "
          f"{fields['fixed_point_share']:.1%})", flush=True)
    return {"fields": fields, "curve": curve}


# ----------------------------------------------------------------------------------------------------------------------
# Claims, tables, pictures
# ----------------------------------------------------------------------------------------------------------------------


def _seeds(archs: dict, arch: str) -> list[dict]:
    return [archs[arch]["seeds"][s] for s in sorted(archs[arch]["seeds"], key=int)]


def _per_seed(values, fmt: str) -> str:
    return " / ".join("n/a" if v is None else format(v, fmt) for v in values)


def analysis_claims(archs: dict) -> list[tuple[str, bool | None, str]]:
    """The paper's four findings per model on the measured numbers: (name, held or None when the model cannot show
    it, the numbers)."""
    out = []
    for arch in (a for a in ARCHS if a in archs):
        fs, label = _seeds(archs, arch), LABELS[arch]
        share = [f["fixed_point_share"] for f in fs]
        out.append((f"{label}: ≥ {FIXED_SHARE:.0%} of tokens reach a fixed point (τ {TAU}, ρ {RHO}), every seed",
                    all(s >= FIXED_SHARE for s in share), f"{_per_seed([100 * s for s in share], '.1f')} % of tokens"))
        score = [f["degenerate_score"] for f in fs]
        out.append((f"{label}: the loop layers' fixed points are distinct (cyclic: degenerate score < {DEGENERATE}), "
                    "every seed", None if None in score else all(s < DEGENERATE for s in score),
                    "one loop layer: no second fixed point to compare" if None in score else
                    f"min_ℓ cos(X*_1, X*_ℓ) {_per_seed(score, '.3f')}; relative distance between the layers' fixed "
                    f"points {_per_seed([f['fixed_point_separation'] for f in fs], '.3f')}, against a last-step "
                    f"motion of {_per_seed([f['final_motion'] for f in fs], '.1e')}"))
        stable = [f["stable_from"] for f in fs]
        out.append((f"{label}: attention stabilises within 1–2 recurrences (every stage metric within {STABLE_TOL} "
                    f"of recurrence {max(r['recurrence'] for r in fs[0]['stages'])} from recurrence {STABLE_BY} on), "
                    "every seed", all(s <= STABLE_BY for s in stable), f"stable from recurrence {_per_seed(stable, 'd')}"))
        rep = [f["stage_repeat_share"] for f in fs]
        out.append((f"{label}: stages repeat per recurrence (≥ {REPEAT_SHARE:.0%} of loop steps nearest to their own "
                    "layer), every seed", None if None in rep else all(r >= REPEAT_SHARE for r in rep),
                    "one loop layer: no stage pattern within a recurrence" if None in rep else
                    f"{_per_seed([100 * r for r in rep], '.0f')} % of steps"))
    return out


def analysis_table(archs: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "parameters", "task quality", "tokens at a fixed point", "degenerate score",
               "stages repeat (steps)", "stable from recurrence"]
    rows = []
    for arch in (a for a in ARCHS if a in archs):
        fs = _seeds(archs, arch)
        quality = (f"exact match {pm([100 * f['exact_match'] for f in fs])} %" if arch == "tah2" else
                   f"held-out loss {pm([f['test_loss'] for f in fs], '.3f')}")
        score = [f["degenerate_score"] for f in fs]
        rep = [f["stage_repeat_share"] for f in fs]
        rows.append([LABELS[arch], f"{fs[0]['parameters']:,}", quality,
                     f"{pm([100 * f['fixed_point_share'] for f in fs])} %",
                     "n/a (one loop layer)" if None in score else pm(score, ".3f"),
                     "n/a (one loop layer)" if None in rep else f"{pm([100 * r for r in rep], '.0f')} %",
                     _per_seed([f["stable_from"] for f in fs], "d")])
    return headers, rows


def _plots(archs: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [a for a in ARCHS if a in archs]
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.2), dpi=110, squeeze=False)
    for ax, arch in zip(axes[0], shown, strict=True):
        for seed, f in sorted(archs[arch]["seeds"].items(), key=lambda kv: int(kv[0])):
            for n, (ell, c) in enumerate(sorted(f["fixed_point_cosine"].items(), key=lambda kv: int(kv[0]))):
                ax.plot(range(1, len(c) + 1), c, color=f"C{n}", alpha=0.7, label=f"loop layer {ell}"
                        if seed == min(archs[arch]["seeds"], key=int) else None)
        ax.set_xscale("log")
        ax.set_xlabel("recurrence t")
        ax.set_title(LABELS[arch], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    axes[0][0].set_ylabel("cos(X_t, X*), X* = X_T_fp")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "fixed_points.png"))
    plt.close(fig)
    fig, axes = plt.subplots(len(STAGE_METRICS), len(shown), figsize=(4 * len(shown), 6.4), dpi=110, squeeze=False,
                             sharex="col")
    for col, arch in enumerate(shown):
        f = _seeds(archs, arch)[0]
        rows = [r for r in f["stages"] if r["recurrence"] <= 8]
        layers = sorted({r["layer"] for r in rows})
        x = [(r["recurrence"] - 1) * len(layers) + layers.index(r["layer"]) + 1 for r in rows]
        for i, k in enumerate(STAGE_METRICS):
            ax = axes[i][col]
            ax.plot(x, [r[k] for r in rows], color="#888888", lw=0.8)
            ax.scatter(x, [r[k] for r in rows], c=[f"C{layers.index(r['layer'])}" for r in rows], s=14, zorder=3)
            ax.set_ylabel(k.replace("_", " "), fontsize=8)
            ax.grid(alpha=0.3)
        axes[0][col].set_title(f"{LABELS[arch]} (seed {min(archs[arch]['seeds'], key=int)})", fontsize=9)
        axes[-1][col].set_xlabel("realised loop step (recurrences 1–8; colour = layer)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "stages.png"))
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------------


def _make_jobs(tmp: str, seeds, quick: bool, steps: int | None, lr: float | None) -> list[AnalysisJob]:
    """Every arch × seed: the corpus models with the SpiralFormer / SGT runs' recipes, TaH2 with the demo's."""
    from ..data import hop_base_dir
    from ..demo.hop import hop_jobs
    from ..demo.settings import hop_settings
    from . import sgt, spiralformer
    from .common import check_run_settings

    probes = QUICK_PROBES if quick else PROBES
    recipes = {"looped-anchor": (spiralformer.QUICK_MODEL if quick else spiralformer.MODEL,
                                 spiralformer.QUICK if quick else spiralformer.TRAINING),
               "block": (sgt.QUICK_MODEL if quick else sgt.MODEL, sgt.QUICK if quick else sgt.TRAINING)}
    hop_training = {"learning_rate": lr} if lr is not None else None
    settings = hop_settings(3 if quick and steps is None else steps, hop_training)
    hop, _ = hop_jobs(tmp, hop_base_dir(), settings, ["tah2"], seeds, 8 if quick else 500, keep_all=True)
    jobs = []
    for seed, h in zip(seeds, hop, strict=True):
        for arch in ARCHS:
            keep = seed == seeds[0]
            if arch == "tah2":
                jobs.append(AnalysisJob(arch, seed, h.ckpt, dict(h.model), settings, probes, keep, hop=h,
                                        settings={"max_steps": settings["max_steps"], "max_length": 96}))
                continue
            model, training = recipes[arch]
            _, training = check_run_settings(seeds, training, steps, lr)
            jobs.append(AnalysisJob(arch, seed, os.path.join(tmp, f"{arch}-seed{seed}"), model, training, probes,
                                    keep, settings={"max_steps": training["steps"], "max_length": training["seq_len"]}))
    return jobs


def _report(tmp: str, quick: bool, seeds, archs: dict, verdicts, seconds: float, jobs) -> None:
    import json

    from ..evaluation.report import markdown_table

    word = {True: "held", False: "did not hold", None: "not measurable"}
    settings = {LABELS[j.arch]: {"model": j.model, "training": j.training} for j in jobs if j.seed == seeds[0]}
    lines = [
        "# hf-loops reproduce analysis" + (" (--quick: a smoke run, not a result)" if quick else ""),
        "",
        f"{len(seeds)} seeds × {len(ARCHS)} looped models, each trained with the recipe of the run it comes from "
        f"(LoopedFormer: `reproduce spiralformer`, with the anchor topology; Block Loop: `reproduce sgt`; TaH2: "
        f"`hf-loops demo`), then probed on held-out data: {PROBES['texts'] if not quick else QUICK_PROBES['texts']} "
        f"test-split passages (corpus models) or held-out hop problems (TaH2). {seconds:.0f} s wall.",
        "",
        markdown_table(*analysis_table(archs)),
        "",
        "## The paper's claims, tested",
        "",
        *(f"- **{word[ok]}:** {n} ({t})" for n, ok, t in verdicts),
        "",
        "![fixed points](fixed_points.png)",
        "",
        "![stages](stages.png)",
        "",
        "## Settings",
        "",
        "```json",
        json.dumps({"probes": QUICK_PROBES if quick else PROBES, "thresholds": {
            "tau": TAU, "rho": RHO, "sink_tau": SINK_TAU, "fixed_share": FIXED_SHARE, "degenerate": DEGENERATE,
            "repeat_share": REPEAT_SHARE, "stable_tol": STABLE_TOL, "stable_by": STABLE_BY}, "runs": settings},
            indent=1, default=str),
        "```",
    ]
    with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def run_analysis(out: str, seeds=SEEDS, quick: bool = False, overwrite: bool = False, workers: int | None = None,
                 steps: int | None = None, lr: float | None = None) -> dict:
    """Every arch × seed, then summary.json, report.md, runs.json, the pictures and the first seed's checkpoints."""
    import shutil

    from .common import check_run_settings, run_reproduction, write_summary

    seeds, _ = check_run_settings(seeds, {}, steps, lr)
    t_start = time.perf_counter()
    made = []

    def make_jobs(tmp):
        made.extend(_make_jobs(tmp, seeds, quick, steps, lr))
        return made

    def write(tmp, runs):
        for extra in ("data", "runs"):  # the hop problems TaH2 trained on; the (empty) folder of runs not kept
            shutil.rmtree(os.path.join(tmp, extra), ignore_errors=True)
        archs = {}
        for (arch, seed), r in runs.items():
            archs.setdefault(arch, {"seeds": {}})["seeds"][str(seed)] = r["fields"]
        verdicts = analysis_claims(archs)
        summary = {"claims": [{"claim": n, "held": ok, "numbers": t} for n, ok, t in verdicts], "archs": archs}
        write_summary(tmp, summary, runs, {j.arch: j.model for j in made if j.seed == seeds[0]},
                      {j.arch: j.training for j in made if j.seed == seeds[0]}, seeds)
        _plots(archs, tmp)
        _report(tmp, quick, seeds, archs, verdicts, time.perf_counter() - t_start, made)
        return {"summary": summary, "tables": [analysis_table(archs)], "claims": verdicts,
                "files": "summary.json, report.md, runs.json, fixed_points.png, stages.png"}

    res = run_reproduction(out, overwrite, make_jobs, run_analysis_one, workers, write)
    return {**res, "seconds": time.perf_counter() - t_start}


__all__ = ["ARCHS", "PROBES", "QUICK_PROBES", "AnalysisJob", "analysis_claims", "analysis_table", "probe",
           "run_analysis", "run_analysis_one", "stable_from", "stage_repeat_share"]
