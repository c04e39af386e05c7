"""`hf-loops demo --task arithmetic`: Standard vs TaH2 vs TaH2-fixed over seeds on the seeded arithmetic task
(`hf_loops.data.arithmetic`).

The claim tested (the paper's): a learned decider that gives extra depth only to the tokens that need it matches or
beats fixed-depth models at a fraction of the extra cost. On this task only the result digits of a calculator step
need computation, so the shares of deep tokens per token class show whether the decider found them, and exact
match / answer NLL over seeds show whether it paid off.

Every run post-trains the embedded base with the same settings and steps (`settings.ARITHMETIC_TRAINING`, chosen on
the validation split) and is evaluated on the held-out split with `hf_loops.evaluation.metrics.evaluate`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

from ..data import arithmetic as A
from ..evaluation.report import markdown_table, output_dir, write_pictures
from .runs import float32_base, run_jobs
from .settings import (
    ARCHS,
    ARITHMETIC_DATA_SEED,
    ARITHMETIC_MAX_NEW_TOKENS,
    ARITHMETIC_SEEDS,
    ARITHMETIC_SIZES,
    ArithmeticOptions,
    RunJob,
    arithmetic_settings,
)
from .stats import aggregate, class_table, cpu_summary, seed_table, verdict


def plot_em_vs_flops(agg: dict, path: str) -> None:
    """Exact match against decode FLOPs ÷ Standard, one point per run and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"standard": "#8fa3bf", "tah2": "#c44e12", "tah2-fixed": "#4c956c"}
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
    for arch, label in ARCHS:
        rs = agg.get(arch) or []
        ax.scatter([r["flops_ratio"] for r in rs], [100 * r["exact_match"] for r in rs], label=label,
                   color=colors[arch], s=36, alpha=0.85)
    ax.set_xlabel("decode FLOPs per token ÷ Standard")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("arithmetic task: one point per run and seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_class_shares(agg: dict, path: str, arch: str = "tah2") -> None:
    """Bar chart: TaH2's share of deep tokens per token class, mean over seeds with the min–max range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = agg.get(arch) or []
    classes = [c for c in A.TOKEN_CLASSES if rs and rs[0]["deep_share"][c]["tokens"]]
    vals = [[100 * r["deep_share"][c]["deep_share"] for r in rs] for c in classes]
    means = [statistics.fmean(v) for v in vals]
    err = [[m - min(v) for m, v in zip(means, vals, strict=True)],
           [max(v) - m for m, v in zip(means, vals, strict=True)]]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
    ax.bar(classes, means, yerr=err, color="#c44e12", alpha=0.85, capsize=3)
    ax.set_ylabel("deep tokens (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"TaH2: share of deep (2-pass) tokens per class, {len(rs)} seeds", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def arithmetic_part(tmp: str, base32: str, options: ArithmeticOptions | None = None):
    """Write the splits into `tmp`/data and return (jobs, finish): `run_jobs(jobs)` trains and evaluates every
    arch × seed, `finish(results)` writes the report, runs.json and pictures into `tmp` and returns the summary.
    Split in two so that `hf-loops demo --task both` runs the GSM8K and arithmetic runs in one pool of workers."""
    options = options or ArithmeticOptions()
    settings = arithmetic_settings(options.steps, options.training, options.progress)
    archs = [a for a, _ in ARCHS if options.archs is None or a in options.archs]
    if "standard" not in archs:
        raise ValueError("the arithmetic demo needs the 'standard' run (the baseline of every ratio)")
    seeds = tuple(options.seeds)
    sizes = {**ARITHMETIC_SIZES, **(options.sizes or {})}
    paths = A.write_splits(os.path.join(tmp, "data"), seed=ARITHMETIC_DATA_SEED, **sizes)
    # every run reads only its max_steps × batch problems (one epoch or less): tokenise only those
    used = settings["max_steps"] * settings["per_device_train_batch_size"]
    train_file = os.path.join(tmp, "runs", "train_used.jsonl")
    os.makedirs(os.path.dirname(train_file))
    with open(paths["train"], encoding="utf-8") as src, open(train_file, "w", encoding="utf-8") as dst:
        dst.writelines(line for _, line in zip(range(used), src, strict=False))
    label_of = dict(ARCHS)
    jobs = [RunJob(task="arithmetic", base=base32, arch=arch, seed=seed, settings=settings, train_file=train_file,
                   ckpt=os.path.join(tmp, "runs", f"{arch}_seed{seed}"), heldout=paths["heldout"],
                   batch_size=sizes["n_heldout"] or 1, max_new_tokens=options.max_new_tokens, name=label_of[arch])
            for seed in seeds for arch in archs]
    t_start = time.perf_counter()

    def finish(results: list[dict]) -> dict:
        shutil.rmtree(os.path.join(tmp, "runs"))
        return _arithmetic_outputs(tmp, jobs, results, settings, seeds, sizes, t_start)

    return jobs, finish


def _arithmetic_outputs(tmp, jobs, results, settings, seeds, sizes, t_start) -> dict:
    runs = {}
    first = []  # the first seed's full results, for the depth pictures
    for job, r in zip(jobs, results, strict=True):
        if job.seed == seeds[0]:
            first.append(r)
        runs.setdefault(job.arch, []).append({
            "seed": job.seed, "metrics": r["metrics"], "train_runtime": r["training"]["train_runtime"],
            "class_shares": A.class_deep_shares(r["examples"]),
            "samples": [e["generated_text"] for e in r["examples"][:3]], "cpu_seconds": r.get("cpu_seconds")})
    agg = aggregate(runs)
    headers, rows = seed_table(agg)
    ch, crows = class_table(agg)
    plot_em_vs_flops(agg, os.path.join(tmp, "em_vs_flops.png"))
    plot_class_shares(agg, os.path.join(tmp, "deep_share_by_class.png"))
    write_pictures(first, tmp)  # depth_map.html/.png of TaH2 (first seed), loss curves
    seconds = time.perf_counter() - t_start
    with open(os.path.join(tmp, "runs.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "seeds": list(seeds), "sizes": sizes, "aggregate": agg,
                   "cpu_seconds": cpu_summary(runs), "runs": runs}, f, indent=1)
    n_held = sizes["n_heldout"]
    report = "\n".join([
        "# hf-loops demo: arithmetic (seeded GSM8K-formatted calculator chains)",
        "",
        f"{len(seeds)} seeds × {len(runs)} runs, {settings['max_steps']} steps each, the same settings; held-out "
        f"split of {n_held} problems that no run trained on (the recipe was chosen on the validation split). "
        f"The runs took {seconds:.0f} s wall, two at a time where two workers ran (training-time ratios are taken "
        "seed by seed, so they carry the noise of whatever ran beside them); process CPU time of the runs "
        f"{cpu_summary(runs)['total']:.0f} s (per run and phase in runs.json).",
        "",
        markdown_table(headers, rows),
        "",
        "## What came out",
        "",
        *verdict(agg),
        "",
        "## Where TaH2 puts depth (held-out answers, teacher-forced)",
        "",
        markdown_table(ch, crows),
        "",
        "Carry digits: computed result digits whose column receives a carry/borrow; result digits: the other "
        "computed digits; copied digits: operands and repeated results.",
        "",
        "![deep share by class](deep_share_by_class.png)",
        "",
        "![per-token depth](depth_map.png)",
        "",
        "![exact match vs decode FLOPs](em_vs_flops.png)",
        "",
        "## Settings",
        "",
        "```json",
        json.dumps(settings, indent=1),
        "```",
    ]) + "\n"
    with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    return {"aggregate": agg, "table": (headers, rows), "class_table": (ch, crows), "seconds": seconds,
            "cpu_seconds": cpu_summary(runs)}


def run_arithmetic_demo(out: str, overwrite: bool = False, seeds=ARITHMETIC_SEEDS, steps: int | None = None,
                        training: dict | None = None, sizes: dict | None = None, archs=None,
                        progress: bool = False, max_new_tokens: int = ARITHMETIC_MAX_NEW_TOKENS,
                        workers: int | None = None) -> dict:
    """Train and evaluate every arch × seed; write `out/` (report.md, runs.json, em_vs_flops.png,
    deep_share_by_class.png, depth_map.html/.png and loss_curves.png of the first seed, data/)."""
    from .. import data

    t_start = time.perf_counter()
    options = ArithmeticOptions(seeds=tuple(seeds), steps=steps, training=training, sizes=sizes,
                                archs=None if archs is None else tuple(archs), progress=progress,
                                max_new_tokens=max_new_tokens)
    arithmetic_settings(steps, training, progress)  # bad input is refused before anything is written
    out_abs = os.path.abspath(out)
    with output_dir(out, overwrite, "--out") as tmp:
        base32 = float32_base(data.default_base_dir(), os.path.join(tmp, "base_fp32"))
        jobs, finish = arithmetic_part(tmp, base32, options)
        results = run_jobs(jobs, workers)
        shutil.rmtree(base32)
        res = finish(results)
    return {**res, "out": out_abs, "seconds": time.perf_counter() - t_start}


__all__ = ["arithmetic_part", "plot_class_shares", "plot_em_vs_flops", "run_arithmetic_demo"]
