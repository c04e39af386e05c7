"""The demo's runs: the training helpers both tasks share (`DEMO_TRAINING`, `float32_base`, `train_one`; `hf_loops.demo`
imports them, so this module never imports the demo) and `hf-loops demo --task arithmetic`: Standard vs TaH2 vs
TaH2-fixed over seeds on the seeded arithmetic task.

The claim tested (the paper's): a learned decider that gives extra depth only to the tokens that need it matches or
beats fixed-depth models at a fraction of the extra cost. On this task only the result digits of a calculator step
need computation (`hf_loops.data.arithmetic`), so the shares of deep tokens per token class show whether the decider
found them, and exact match / answer NLL over seeds show whether it paid off.

Every run post-trains the embedded base with the same settings and steps (`ARITHMETIC_TRAINING`, chosen on the
validation split) and is evaluated on the held-out split with `hf_loops.evaluation.evaluate`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

from .data import arithmetic as A
from .evaluation.examples import load_examples
from .evaluation.metrics import TRAIN_SUMMARY, evaluate
from .evaluation.report import output_dir, write_pictures

# ---------------------------------------------------------------- the run helpers both demo tasks share

# The settings both runs share (TaH2SFTConfig fields). Sized so the whole demo fits in 5 minutes on 2 CPU cores.
DEMO_TRAINING = {
    # 10 steps (was 20) to fit make demo's CPU budget; validation (the last 10 of the 80 training problems held out,
    # seed 0) says it costs answer NLL: Standard 2.468 vs 2.420 at 20 steps, TaH2 2.470 vs 2.456.
    "max_steps": 10,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 2,
    "per_device_train_batch_size": 8,
    "max_length": 384,
    "weight_decay": 0.01,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    # α_D (TaH2 only; inert for Standard, which has no decider). The paper's 0.05 collapses the decider at this scale:
    # the fresh updater's depth-2 predictions are poor at first, the NTP gradient through the mixture pushes every g
    # below τ within two steps (measured: mean depth 1.000 from step 3 on, never recovering), and with no token
    # continuing the updater gets no NTP gradient to improve. 1.0 lets the lookahead labels hold the decider up.
    "decider_loss_weight": 1.0,
}
def float32_base(base: str, dest: str) -> str:
    """Copy the Qwen3 base (a directory or Hub id, any stored dtype) to `dest` in float32 with its tokenizer: both
    runs post-train fp32 weights on the CPU (the embedded base is stored in bfloat16 to keep the package small)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation.examples import looks_like_path

    if looks_like_path(base) and not os.path.isdir(base):
        raise ValueError(f"--base {base!r}: no such directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load --base {base!r}: {str(err).splitlines()[0]}") from None
    if model.config.model_type != "qwen3":
        raise ValueError(f"--base must be a Qwen3(-Base) checkpoint, got model_type {model.config.model_type!r}")
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def train_one(base: str, arch: str, train_file: str, out: str, settings: dict, seed: int,
              max_iterations: int | None = None) -> dict:
    """Post-train one run with `hf_loops.training.train_tah2.train` (what `hf-loops train` runs); write and return
    its training summary."""
    from .training.train_tah2 import train

    t0 = time.perf_counter()
    # a looped preset takes the demo's M; the Standard preset is one pass (M = 1)
    model = {"max_iterations": max_iterations} if arch != "standard" and max_iterations is not None else None
    trainer = train(base, train_file, out, arch, model=model, trainer={**settings, "seed": seed})
    wall = time.perf_counter() - t0
    history = [dict(h) for h in trainer.state.log_history]
    final = next((h for h in reversed(history) if "train_runtime" in h), {})
    steps_logged = [h for h in history if "loss" in h]
    acc = [h["decider_acc@1"] for h in steps_logged if "decider_acc@1" in h]
    tail = max(1, len(acc) // 5)
    summary = {
        "arch": arch,
        "steps": trainer.state.global_step,
        "train_runtime": final.get("train_runtime"),
        "wall_seconds": wall,
        "settings": {**settings, "seed": seed},
        "final_ntp_loss": (steps_logged[-1].get("ntp_loss", steps_logged[-1].get("loss")) if steps_logged else None),
        "decider_acc": sum(acc[-tail:]) / tail if acc else None,
        "decider_acc_window": tail if acc else 0,
        "log_history": [{k: v for k, v in h.items() if isinstance(v, (int, float, str))} for h in history],
    }
    with open(os.path.join(out, TRAIN_SUMMARY), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


# ---------------------------------------------------------------- the arithmetic task

def arch_label(preset: str, max_iterations: int = 2) -> str:
    """A demo run's name in tables, from the architecture registry's display name of its TaH2 preset (the preset's
    fields over TaH2Config's defaults, at the demo's M): "Standard (M=1)", "TaH2 (M=2)", "TaH2-fixed (M=2)"."""
    from types import SimpleNamespace

    from .conversion.registry import ARCHITECTURES
    from .modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config

    fields = {"max_iterations": max_iterations, "decider": TaH2Config().decider, **TAH2_PRESETS[preset]}
    return ARCHITECTURES["tah2"].display(SimpleNamespace(**fields))


ARCHS = tuple((a, arch_label(a)) for a in ("standard", "tah2", "tah2-fixed"))
SEEDS = (0, 1, 2)
SIZES = {"n_train": 2000, "n_validation": 40, "n_heldout": 40}
DATA_SEED = 0
MAX_NEW_TOKENS = 80

# Shared by every run (TaH2SFTConfig fields); on top of the GSM8K demo's settings (`DEMO_TRAINING`).
# Chosen on the validation split (examples/arithmetic_sweep.py); departures from the paper are listed in the report.
ARITHMETIC_TRAINING = {
    # 40 steps (was 60) to fit make demo's CPU budget; on the validation split (seed 0) it costs answer NLL:
    # Standard 1.272 vs 1.239 at 60 steps, TaH2 1.289 vs 1.252 (TaH2 - Standard +0.017 vs +0.013).
    "max_steps": 40,
    "max_length": 160,
    "logging_steps": 10,
    # The authors' threshold warm-up (τ from ~0 over the first third): validation answer NLL 1.283 vs 1.295 without
    # (one seed, lr 3e-3, 60 steps); inert for Standard and TaH2-fixed, which have no learned decider.
    "base_warmup_steps": 13,
}


def _spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _pm(values, spec=".3f", scale=1.0) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m, s = _spread([v * scale for v in values])
    return f"{m:{spec}} ± {s:{spec}}"


def aggregate(runs: dict[str, list[dict]]) -> dict:
    """Per arch: the per-seed values and their mean/spread, ratios to Standard taken seed by seed."""
    std = {r["seed"]: r for r in runs["standard"]}
    out = {}
    for arch, rs in runs.items():
        rows = []
        for r in rs:
            m, base = r["metrics"], std[r["seed"]]["metrics"]
            rows.append({
                "seed": r["seed"], "exact_match": m["exact_match"], "answer_nll": m["answer_nll"],
                "mean_depth": m.get("mean_depth") or 1.0, "mean_depth_generated": m.get("mean_depth_generated") or 1.0,
                "flops_ratio": m["decode_flops_per_token"] / base["decode_flops_per_token"],
                "train_ratio": r["train_runtime"] / std[r["seed"]]["train_runtime"],
                "deep_share": r["class_shares"],
            })
        out[arch] = rows
    return out


def cpu_summary(runs: dict[str, list[dict]]) -> dict:
    """Process CPU seconds of the runs (`run_job`'s "cpu_seconds"): per arch the mean per run of each phase, and the
    total of every run and phase."""
    out = {"per_run_mean": {}, "total": 0.0}
    for arch, rs in runs.items():
        cs = [r["cpu_seconds"] for r in rs if r.get("cpu_seconds")]
        if cs:
            # 3 decimals: a tiny run's evaluation takes under 0.05 s, which one decimal rounds to 0.0
            out["per_run_mean"][arch] = {k: round(statistics.fmean(c[k] for c in cs), 3) for k in cs[0]}
            out["total"] += sum(sum(c.values()) for c in cs)
    out["total"] = round(out["total"], 1)
    return out


def table(agg: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "exact match (held out)", "answer NLL", "mean depth", "mean depth (generated)",
               "decode FLOPs ÷ Standard", "training time ÷ Standard"]
    rows = []
    for arch, label in ARCHS:
        rs = agg.get(arch)
        if not rs:
            continue
        rows.append([label, _pm([r["exact_match"] for r in rs], ".1f", 100.0) + " %",
                     _pm([r["answer_nll"] for r in rs]), _pm([r["mean_depth"] for r in rs]),
                     _pm([r["mean_depth_generated"] for r in rs]), _pm([r["flops_ratio"] for r in rs], ".2f") + "×",
                     _pm([r["train_ratio"] for r in rs], ".2f") + "×"])
    return headers, rows


def class_table(agg: dict, arch: str = "tah2") -> tuple[list[str], list[list[str]]]:
    """Share of deep tokens per token class (mean ± spread over seeds) and the token counts."""
    rs = agg.get(arch) or []
    rows = []
    for c in A.TOKEN_CLASSES:
        shares = [r["deep_share"][c]["deep_share"] for r in rs]
        n = rs[0]["deep_share"][c]["tokens"] if rs else 0
        if n:
            rows.append([c, str(n), _pm(shares, ".1f", 100.0) + " %"])
    return ["token class", "tokens per run", "deep (2 passes)"], rows


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


def verdict(agg: dict) -> list[str]:
    """What the measured numbers say about the claim, with the spread; no claim beyond them."""
    def mean(arch, key):
        return statistics.fmean(r[key] for r in agg[arch])

    em = {a: [r["exact_match"] for r in agg[a]] for a in agg}
    wins = sum(t > s for t, s in zip(em["tah2"], em["standard"], strict=True))
    lines = [f"- **Exact match, TaH2 vs Standard:** {_pm(em['tah2'], '.1f', 100.0)} % vs "
             f"{_pm(em['standard'], '.1f', 100.0)} % (mean ± std over {len(em['tah2'])} seeds); TaH2 ahead in "
             f"{wins} of {len(em['tah2'])} seeds, at {mean('tah2', 'flops_ratio'):.2f}× Standard's decode FLOPs."]
    d_nll = mean("tah2", "answer_nll") - mean("standard", "answer_nll")
    lines.append(f"- **Answer NLL:** TaH2 {'lower' if d_nll < 0 else 'higher'} than Standard by {abs(d_nll):.3f} "
                 f"nats/token on average.")
    if "tah2-fixed" in agg:
        lines.append(f"- **TaH2-fixed** (every token at depth 2): exact match {_pm(em['tah2-fixed'], '.1f', 100.0)} %, "
                     f"answer NLL {mean('tah2-fixed', 'answer_nll'):.3f}, at "
                     f"{mean('tah2-fixed', 'flops_ratio'):.2f}× decode FLOPs.")
    ahead = wins == len(em["tah2"]) and statistics.fmean(em["tah2"]) > statistics.fmean(em["standard"])
    lines.append("- **Verdict:** " + ("the claim held on this task, in every seed." if ahead else
                 "the claim did **not** hold on this task at this scale: TaH2 is not ahead of Standard in every "
                 "seed (numbers above)."))
    return lines


def default_workers() -> int:
    """Worker processes for the runs: one per core, at most 2 (each runs torch at 1 thread; at this model size one
    run gains nothing from a second thread, so two runs side by side use two cores fully)."""
    return max(1, min(2, os.cpu_count() or 1))


def _job_cost(job: dict) -> float:
    """A rough relative cost, to start the longest runs first (the last worker to finish sets the wall time)."""
    depth = 1.0 if job["arch"] == "standard" else 2.3
    return job["settings"]["max_steps"] * job["settings"].get("max_length", 160) * depth


_WORKER_STARTED = False  # whether this process has run a job yet (its first carries the start-up CPU time)


def run_job(job: dict) -> dict:
    """One run, in a worker: post-train, evaluate on the held-out file, remove the checkpoint unless `keep`.
    Returns `evaluate`'s result with the training summary under "training" and the process CPU seconds per phase
    under "cpu_seconds" (startup, train, evaluate)."""
    from .evaluation.cli import set_threads

    global _WORKER_STARTED
    set_threads(job.get("threads", 1))
    t0 = time.perf_counter()
    # Process CPU time per phase (load-independent, unlike wall time on a shared machine); the first job of a
    # process also carries the process's start-up (what it imported before this job; an import made later, such as
    # TRL's on the first training, falls into that phase).
    c0 = time.process_time()
    cpu = {"startup": 0.0 if _WORKER_STARTED else c0}
    _WORKER_STARTED = True
    train_one(job["base"], job["arch"], job["train_file"], job["ckpt"], job["settings"], job["seed"],
              job.get("max_iterations"))
    c1 = time.process_time()
    r = evaluate(job["ckpt"], examples=load_examples(job["heldout"]), batch_size=job["batch_size"],
                 max_new_tokens=job["max_new_tokens"], progress=False,
                 decider_accuracy=job.get("decider_accuracy", False), name=job.get("name"))
    cpu.update(train=c1 - c0, evaluate=time.process_time() - c1)
    r["cpu_seconds"] = cpu
    if not job.get("keep"):
        shutil.rmtree(job["ckpt"])
    print(f"[demo] {job['task']} seed {job['seed']}: {job['arch']} done ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return r


def run_jobs(jobs: list[dict], workers: int | None = None) -> list[dict]:
    """`run_job` over `jobs` (results in the order given), longest first, on `workers` processes (1: in this
    process). Runs are independent (each has its own seed, output folder and threads), so the order and the
    worker a run lands on do not change its numbers; only its wall time, which the report says."""
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    order = sorted(range(len(jobs)), key=lambda i: -_job_cost(jobs[i]))
    results: list[dict | None] = [None] * len(jobs)
    if workers == 1 or len(jobs) == 1:
        for i in order:
            results[i] = run_job(jobs[i])
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked child inherits torch's thread pools in whatever state the parent left them
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {i: pool.submit(run_job, jobs[i]) for i in order}
        for i, f in futures.items():
            results[i] = f.result()
    return results


def arithmetic_settings(steps: int | None = None, training: dict | None = None, progress: bool = False) -> dict:
    settings = {**DEMO_TRAINING, **ARITHMETIC_TRAINING, **({} if progress else {"disable_tqdm": True}),
                **(training or {})}
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--steps must be an integer >= 1, got {steps!r}")
        settings["max_steps"] = steps
    return settings


def arithmetic_part(tmp: str, base32: str, seeds=SEEDS, steps: int | None = None, training: dict | None = None,
                    sizes: dict | None = None, archs=None, progress: bool = False,
                    max_new_tokens: int = MAX_NEW_TOKENS):
    """Write the splits into `tmp`/data and return (jobs, finish): `run_jobs(jobs)` trains and evaluates every
    arch × seed, `finish(results)` writes the report, runs.json and pictures into `tmp` and returns the summary.
    Split in two so that `hf-loops demo --task both` runs the GSM8K and arithmetic runs in one pool of workers."""
    settings = arithmetic_settings(steps, training, progress)
    archs = [a for a, _ in ARCHS if archs is None or a in archs]
    if "standard" not in archs:
        raise ValueError("the arithmetic demo needs the 'standard' run (the baseline of every ratio)")
    seeds = tuple(seeds)
    sizes = {**SIZES, **(sizes or {})}
    paths = A.write_splits(os.path.join(tmp, "data"), seed=DATA_SEED, **sizes)
    # every run reads only its max_steps × batch problems (one epoch or less): tokenise only those
    used = settings["max_steps"] * settings["per_device_train_batch_size"]
    train_file = os.path.join(tmp, "runs", "train_used.jsonl")
    os.makedirs(os.path.dirname(train_file))
    with open(paths["train"], encoding="utf-8") as src, open(train_file, "w", encoding="utf-8") as dst:
        dst.writelines(line for _, line in zip(range(used), src, strict=False))
    label_of = dict(ARCHS)
    jobs = [{"task": "arithmetic", "base": base32, "arch": arch, "seed": seed, "settings": settings,
             "train_file": train_file, "ckpt": os.path.join(tmp, "runs", f"{arch}_seed{seed}"),
             "heldout": paths["heldout"], "batch_size": sizes["n_heldout"] or 1, "max_new_tokens": max_new_tokens,
             "name": label_of[arch]} for seed in seeds for arch in archs]
    t_start = time.perf_counter()

    def finish(results: list[dict]) -> dict:
        shutil.rmtree(os.path.join(tmp, "runs"))
        return _arithmetic_outputs(tmp, jobs, results, settings, seeds, sizes, t_start)

    return jobs, finish


def _arithmetic_outputs(tmp, jobs, results, settings, seeds, sizes, t_start) -> dict:
    from .evaluation.report import markdown_table

    runs = {}
    first = []  # the first seed's full results, for the depth pictures
    for job, r in zip(jobs, results, strict=True):
        if job["seed"] == seeds[0]:
            first.append(r)
        runs.setdefault(job["arch"], []).append({
            "seed": job["seed"], "metrics": r["metrics"], "train_runtime": r["training"]["train_runtime"],
            "class_shares": A.class_deep_shares(r["examples"]),
            "samples": [e["generated_text"] for e in r["examples"][:3]], "cpu_seconds": r.get("cpu_seconds")})
    agg = aggregate(runs)
    headers, rows = table(agg)
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


def run_arithmetic_demo(out: str, overwrite: bool = False, seeds=SEEDS, steps: int | None = None,
                        training: dict | None = None, sizes: dict | None = None, archs=None,
                        progress: bool = False, max_new_tokens: int = MAX_NEW_TOKENS,
                        workers: int | None = None) -> dict:
    """Train and evaluate every arch × seed; write `out/` (report.md, runs.json, em_vs_flops.png,
    deep_share_by_class.png, depth_map.html/.png and loss_curves.png of the first seed, data/)."""
    from . import data

    t_start = time.perf_counter()
    arithmetic_settings(steps, training, progress)  # bad input is refused before anything is written
    out_abs = os.path.abspath(out)
    with output_dir(out, overwrite, "--out") as tmp:
        base32 = float32_base(data.default_base_dir(), os.path.join(tmp, "base_fp32"))
        jobs, finish = arithmetic_part(tmp, base32, seeds, steps, training, sizes, archs, progress, max_new_tokens)
        results = run_jobs(jobs, workers)
        shutil.rmtree(base32)
        res = finish(results)
    return {**res, "out": out_abs, "seconds": time.perf_counter() - t_start}


__all__ = ["ARCHS", "ARITHMETIC_TRAINING", "aggregate", "arch_label", "arithmetic_part", "class_table", "cpu_summary",
           "default_workers",
           "run_arithmetic_demo", "run_jobs", "table", "verdict"]
