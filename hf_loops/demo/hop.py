"""`hf-loops demo --task hop` (what `make demo` runs): Standard vs TaH2 vs TaH2-fixed over seeds on the depth-bound
k-hop lookup task (`hf_loops.data.hop_task`), post-trained from a base that already knows one hop.

The claim tested (the paper's): a learned decider that gives a second pass only to the tokens that need it beats
Standard, and gets most of fixed depth's gain at a fraction of its extra cost. The base (`hf_loops.data.hop_base_dir()`,
a 2-layer Qwen3 pretrained on 1-hop problems) answers one hop in one pass; a 2-hop result needs the lookup twice, which
two layers cannot do (a 2-layer model trained from scratch on 1- and 2-hop problems stays at chance on 2-hop letters,
`experiments/depth_bound/README.md`). Every run post-trains the base on the same 1- and 2-hop problems with the same
settings and steps (`settings.HOP_TRAINING`, chosen on the validation split) and is scored on the held-out test split
exactly as `hf-loops eval CKPT --task hop --json` scores it (`hf_loops.evaluation.tasks.task_summary`).

Writes OUT/summary.json (`{"tasks": {"hop": {"archs": {ARCH: {"seeds": {SEED: FIELDS}}}}}}`), OUT/report.md and
OUT/hop/: the seed-0 checkpoints (ARCH-seed0/), runs.json, accuracy_by_difficulty.png, deep_share_by_difficulty.png,
depth_map.html/.png, loss_curves.png, the post-training problems (data/train.jsonl).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

from ..data import hop_task
from ..evaluation.report import markdown_table, output_dir, write_pictures
from ..evaluation.tasks import DEPTH_SUMMARY_FIELDS, HopTaskRun
from .runs import run_jobs
from .settings import (
    ARCHS,
    HOP_EVAL_BATCH,
    HOP_HELDOUT_DATA_SEED,
    HOP_MODEL,
    HOP_SIZES,
    HOP_SPEC,
    HOP_TRAIN_DATA_SEED,
    HopOptions,
    RunJob,
    hop_settings,
)
from .stats import pm, spread

TASK = "hop"
COLORS = {"standard": "#8fa3bf", "tah2": "#c44e12", "tah2-fixed": "#4c956c"}
_LABEL = dict(ARCHS)


def _seeds(task: dict, arch: str) -> list[dict]:
    """The per-seed FIELDS of `arch` in seed order."""
    seeds = task["archs"].get(arch, {}).get("seeds", {})
    return [seeds[k] for k in sorted(seeds, key=int)]


def _level_values(fields: list[dict], level: str, key: str) -> list[float]:
    return [f["by_difficulty"][level][key] for f in fields if f["by_difficulty"][level][key] is not None]


def summary_table(task: dict) -> tuple[list[str], list[list[str]]]:
    """The README's first table: per arch, mean ± std over seeds of every FIELD but by_difficulty, and the per-seed
    exact match."""
    headers = ["run", "exact match", "per seed", "answer NLL", "mean depth", "depth (generated)",
               "decode FLOPs ÷ Std", "training time ÷ Std"]
    rows = []
    for arch, label in ARCHS:
        fs = _seeds(task, arch)
        if not fs:
            continue
        rows.append([label, pm([f["exact_match"] for f in fs], ".1f", 100.0) + " %",
                     " / ".join(f"{100 * f['exact_match']:.1f}" for f in fs),
                     pm([f["answer_nll"] for f in fs], ".4f"),
                     pm([f["mean_depth"] or 1.0 for f in fs]),
                     pm([f["generated_depth"] or 1.0 for f in fs]),
                     pm([f["decode_flops_ratio"] for f in fs], ".2f") + "×",
                     pm([f["train_time_ratio"] for f in fs], ".2f") + "×"])
    return headers, rows


def difficulty_table(task: dict) -> tuple[list[str], list[list[str]]]:
    """Per difficulty level: teacher-forced accuracy per arch and TaH2's deep share (mean ± std over seeds)."""
    levels = HOP_SPEC.levels
    any_fields = next(fs for fs in (_seeds(task, a) for a, _ in ARCHS) if fs)
    headers = ["level", "tokens per run", *(f"accuracy, {label}" for a, label in ARCHS if _seeds(task, a)),
               "deep share, TaH2"]
    rows = []
    for level in levels:
        row = [level, str(any_fields[0]["by_difficulty"][level]["tokens"])]
        row += [pm(_level_values(_seeds(task, a), level, "accuracy"), ".1f", 100.0) + " %"
                for a, _ in ARCHS if _seeds(task, a)]
        row.append(pm(_level_values(_seeds(task, "tah2"), level, "deep_share"), ".1f", 100.0) + " %")
        rows.append(row)
    return headers, rows


def claims(task: dict) -> list[tuple[str, bool | None, str]]:
    """The issue's four tests of the claim on the summary, each (name, held, the numbers); None: not measurable
    (an arch missing)."""
    std, tah, fix = (_seeds(task, a) for a in ("standard", "tah2", "tah2-fixed"))
    out = []
    if std and tah:
        em_s, em_t = [f["exact_match"] for f in std], [f["exact_match"] for f in tah]
        wins = sum(t > s for t, s in zip(em_t, em_s, strict=True))
        gain = statistics.fmean(em_t) - statistics.fmean(em_s)
        sd = max(spread(em_t)[1], spread(em_s)[1])
        out.append(("TaH2 above Standard in every seed, mean gain ≥ 2 × the larger std",
                    wins == len(em_t) and gain >= 2 * sd,
                    f"ahead in {wins} of {len(em_t)} seeds; gain {100 * gain:+.1f} points, larger std "
                    f"{100 * sd:.1f} points"))
    if std and tah and fix:
        g_t = statistics.fmean(f["exact_match"] for f in tah) - statistics.fmean(f["exact_match"] for f in std)
        g_f = statistics.fmean(f["exact_match"] for f in fix) - statistics.fmean(f["exact_match"] for f in std)
        x_t = statistics.fmean(f["decode_flops_ratio"] for f in tah) - 1
        x_f = statistics.fmean(f["decode_flops_ratio"] for f in fix) - 1
        # a non-positive fixed gain is "got all of it" when TaH2's own gain is at least as large
        share_ok = g_t >= 0.8 * g_f if g_f > 0 else g_t >= g_f
        out.append(("TaH2 gets ≥ 80 % of TaH2-fixed's exact-match gain at ≤ 60 % of its extra decode FLOPs",
                    share_ok and x_t <= 0.6 * x_f,
                    f"gain over Standard: TaH2 {100 * g_t:+.1f}, TaH2-fixed {100 * g_f:+.1f} points; extra decode "
                    f"FLOPs: TaH2 {x_t:+.2f}, TaH2-fixed {x_f:+.2f} (ratio {x_t / x_f if x_f else float('nan'):.2f})"))
    if tah:
        hard = HOP_SPEC.levels[-1]
        d_hard = statistics.fmean(_level_values(tah, hard, "deep_share"))
        d_copy = statistics.fmean(_level_values(tah, "copy", "deep_share"))
        out.append((f"TaH2's deep share on level {hard} ≥ 3 × its deep share on copy tokens", d_hard >= 3 * d_copy,
                    f"level {hard} {100 * d_hard:.1f} %, copy {100 * d_copy:.1f} % "
                    f"({d_hard / d_copy if d_copy else float('inf'):.1f}×)"))
    return out


def summary_markdown(summary: dict) -> str:
    """The README's first tables from a `summary.json` object: the runs (mean ± std over seeds, per-seed exact
    match), then accuracy and TaH2's deep share per difficulty level."""
    task = summary["tasks"][TASK]
    return markdown_table(*summary_table(task)) + "\n\n" + markdown_table(*difficulty_table(task))


def plot_accuracy_by_difficulty(task: dict, path: str) -> None:
    """x = difficulty level, y = teacher-forced accuracy (mean over seeds, min–max bars), one line per arch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(HOP_SPEC.levels)
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
    for arch, label in ARCHS:
        fs = _seeds(task, arch)
        if not fs:
            continue
        vals = [[100 * v for v in _level_values(fs, lv, "accuracy")] for lv in levels]
        means = [statistics.fmean(v) for v in vals]
        err = [[m - min(v) for m, v in zip(means, vals, strict=True)],
               [max(v) - m for m, v in zip(means, vals, strict=True)]]
        ax.errorbar(levels, means, yerr=err, marker="o", capsize=3, label=label, color=COLORS[arch])
    ax.set_xlabel("difficulty (copy, hops)")
    ax.set_ylabel("held-out token accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"hop task: accuracy per difficulty, {len(_seeds(task, 'standard'))} seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_deep_share(task: dict, path: str, arch: str = "tah2") -> None:
    """Bars: TaH2's share of deep (2-pass) tokens per difficulty level, mean over seeds with the min–max range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(HOP_SPEC.levels)
    fs = _seeds(task, arch)
    vals = [[100 * v for v in _level_values(fs, lv, "deep_share")] for lv in levels]
    means = [statistics.fmean(v) for v in vals]
    err = [[m - min(v) for m, v in zip(means, vals, strict=True)],
           [max(v) - m for m, v in zip(means, vals, strict=True)]]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
    ax.bar(levels, means, yerr=err, color=COLORS[arch], alpha=0.85, capsize=3)
    ax.set_xlabel("difficulty (copy, hops)")
    ax.set_ylabel("deep tokens (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"TaH2: share of tokens sent to pass 2, {len(fs)} seeds", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def hop_jobs(root: str, base: str, settings: dict, archs, seeds, n_heldout: int = HOP_SIZES["n_heldout"],
             batch_size: int = HOP_EVAL_BATCH, keep_all: bool = False) -> tuple[list[RunJob], HopTaskRun]:
    """Write the post-training problems into `root`/data; one `RunJob` per seed × arch (seed-major) and the held-out
    problems they are scored on. The first seed's checkpoints go to `root`/ARCH-seedS and are kept; the others to
    `root`/runs/ARCH-seedS, removed after scoring unless `keep_all` (then every seed's is kept at `root`/ARCH-seedS)."""
    # every run reads max_steps × batch problems (one epoch), the same ones in a seed-dependent order
    n_train = settings["max_steps"] * settings["per_device_train_batch_size"]
    train_file = hop_task.write_sft(os.path.join(root, "data", "train.jsonl"),
                                    hop_task.make_split("train", n_train, HOP_TRAIN_DATA_SEED, HOP_SPEC))
    heldout = HopTaskRun(HOP_SPEC, n_heldout, HOP_HELDOUT_DATA_SEED, "test")
    os.makedirs(os.path.join(root, "runs"), exist_ok=True)
    jobs = []
    for seed in seeds:
        keep = keep_all or seed == seeds[0]
        for arch in archs:
            ckpt = os.path.join(root, f"{arch}-seed{seed}") if keep else os.path.join(root, "runs", f"{arch}-seed{seed}")
            jobs.append(RunJob(task=TASK, base=base, arch=arch, seed=seed, settings=settings, train_file=train_file,
                               heldout=heldout.describe(), batch_size=min(n_heldout, batch_size), ckpt=ckpt,
                               max_new_tokens=heldout.max_new_tokens(), keep=keep, name=_LABEL[arch],
                               model=None if arch == "standard" else dict(HOP_MODEL), task_run=heldout))
    return jobs, heldout


def hop_part(tmp: str, base: str, options: HopOptions | None = None):
    """Write the post-training problems into `tmp`/hop/data and return (jobs, finish): `run_jobs(jobs)` trains and
    evaluates every arch × seed, `finish(results)` writes summary.json, report.md, runs.json and the pictures."""
    options = options or HopOptions()
    settings = hop_settings(options.steps, options.training, options.progress)
    archs = [a for a, _ in ARCHS if options.archs is None or a in options.archs]
    if "standard" not in archs:
        raise ValueError("the hop demo needs the 'standard' run (the baseline of every ratio)")
    seeds = tuple(options.seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: need distinct seeds, got {seeds}")
    root = os.path.join(tmp, TASK)
    jobs, heldout = hop_jobs(root, base, settings, archs, seeds, options.n_heldout, options.batch_size)
    t_start = time.perf_counter()

    def finish(results: list[dict]) -> dict:
        shutil.rmtree(os.path.join(root, "runs"))
        return _outputs(tmp, jobs, results, settings, seeds, heldout, t_start)

    return jobs, finish


def _outputs(tmp, jobs, results, settings, seeds, heldout, t_start) -> dict:
    root = os.path.join(tmp, TASK)
    runtime = {(j.arch, j.seed): r["training"]["train_runtime"] for j, r in zip(jobs, results, strict=True)}
    archs = {}
    for job, r in zip(jobs, results, strict=True):
        fields = {**r["summary"], "train_time_ratio": runtime[job.arch, job.seed] / runtime["standard", job.seed]}
        archs.setdefault(job.arch, {"seeds": {}})["seeds"][str(job.seed)] = {k: fields[k] for k in
                                                                             DEPTH_SUMMARY_FIELDS}
    task = {"archs": archs}
    summary = {"tasks": {TASK: task}}
    with open(os.path.join(tmp, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    first = [r for j, r in zip(jobs, results, strict=True) if j.seed == seeds[0]]
    write_pictures(first, root)  # depth_map.html/.png of TaH2 (first seed), loss curves
    cls_plot = os.path.join(root, "depth_by_token_class.png")  # digit/word classes: no meaning on this task
    if os.path.exists(cls_plot):
        os.remove(cls_plot)
    plot_accuracy_by_difficulty(task, os.path.join(root, "accuracy_by_difficulty.png"))
    if "tah2" in archs:
        plot_deep_share(task, os.path.join(root, "deep_share_by_difficulty.png"))
    seconds = time.perf_counter() - t_start
    runs = [{"arch": j.arch, "seed": j.seed, "metrics": r["metrics"], "training": r["training"],
             "cpu_seconds": r.get("cpu_seconds"), "samples": [e["generated_text"] for e in r["examples"][:3]]}
            for j, r in zip(jobs, results, strict=True)]
    with open(os.path.join(root, "runs.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "model": HOP_MODEL, "seeds": list(seeds), "heldout": heldout.describe(),
                   "train_data_seed": HOP_TRAIN_DATA_SEED, "runs": runs}, f, indent=1)
    verdicts = claims(task)
    report = "\n".join([
        "# hf-loops demo: the depth-bound hop task",
        "",
        f"{len(seeds)} seeds × {len(archs)} runs, {settings['max_steps']} steps each, the same settings, from the "
        f"embedded 1-hop base; scored on the held-out {heldout.describe()} (no run trained on it, no choice was made "
        f"on it). The runs took {seconds:.0f} s wall.",
        "",
        markdown_table(*summary_table(task)),
        "",
        "## The claim, tested",
        "",
        *(f"- **{'held' if ok else 'did not hold' if ok is not None else 'not measured'}:** {name} ({text})"
          for name, ok, text in verdicts),
        "",
        "## Where depth goes (held-out answers, teacher-forced)",
        "",
        markdown_table(*difficulty_table(task)),
        "",
        "Level 1 / 2: a result letter one / two hops away; copy: every other answer character (the answer line's "
        "prefix, the restated queries, spaces) and the end of turn.",
        "",
        "![accuracy by difficulty](hop/accuracy_by_difficulty.png)",
        "",
        "![deep share by difficulty](hop/deep_share_by_difficulty.png)",
        "",
        "![per-token depth](hop/depth_map.png)",
        "",
        "## Settings",
        "",
        "```json",
        json.dumps({"training": settings, "model (looped runs)": HOP_MODEL}, indent=1),
        "```",
        "",
        f"Check a checkpoint on fresh problems: `hf-loops eval OUT/hop/tah2-seed{seeds[0]} --task hop --data-seed 1 "
        "--n 200 --json`.",
    ]) + "\n"
    with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    return {"summary": summary, "table": summary_table(task), "difficulty_table": difficulty_table(task),
            "claims": verdicts, "seconds": seconds}


def run_hop_demo(out: str, overwrite: bool = False, options: HopOptions | None = None, workers: int | None = None,
                 base: str | None = None) -> dict:
    """Train and evaluate every arch × seed from the embedded hop base (or `base`); write `out/` (summary.json,
    report.md, hop/)."""
    from .. import data

    t_start = time.perf_counter()
    options = options or HopOptions()
    hop_settings(options.steps, options.training, options.progress)  # bad input is refused before anything is written
    out_abs = os.path.abspath(out)
    with output_dir(out, overwrite, "--out") as tmp:
        jobs, finish = hop_part(tmp, base or data.hop_base_dir(), options)
        res = finish(run_jobs(jobs, workers))
    return {**res, "out": out_abs, "seconds": time.perf_counter() - t_start}


__all__ = ["claims", "difficulty_table", "hop_jobs", "hop_part", "summary_markdown", "plot_accuracy_by_difficulty", "plot_deep_share",
           "run_hop_demo", "summary_table"]
