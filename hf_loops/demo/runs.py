"""The demo's runs, both tasks: the base copied to float32 once, one run post-trained (`train_one`, what `hf-loops
train` runs) and evaluated (`hf_loops.evaluation.metrics.evaluate`, what `hf-loops eval` runs), and a pool of worker
processes for the `RunJob`s of a demo."""

from __future__ import annotations

import json
import os
import shutil
import time

from ..evaluation.cli import set_threads
from ..evaluation.examples import load_examples, looks_like_path
from ..evaluation.metrics import TRAIN_SUMMARY, evaluate
from ..evaluation.tasks import task_summary
from .settings import RunJob


def float32_base(base: str, dest: str) -> str:
    """Copy the Qwen3 base (a directory or Hub id, any stored dtype) to `dest` in float32 with its tokenizer: both
    runs post-train fp32 weights on the CPU (the embedded base is stored in bfloat16 to keep the package small)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
              max_iterations: int | None = None, model_fields: dict | None = None) -> dict:
    """Post-train one run with `hf_loops.training.train_tah2.train` (what `hf-loops train` runs); write and return
    its training summary. `model_fields`: TaH2Config fields of a looped run (the Standard preset takes none)."""
    from ..training.train_tah2 import train

    t0 = time.perf_counter()
    # a looped preset takes the demo's M and model fields; the Standard preset is one pass (M = 1)
    model = None
    if arch != "standard" and (max_iterations is not None or model_fields):
        model = {**(model_fields or {}), **({"max_iterations": max_iterations} if max_iterations is not None else {})}
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


def default_workers() -> int:
    """Worker processes for the runs: one per core, at most 2 (each runs torch at 1 thread; at this model size one
    run gains nothing from a second thread, so two runs side by side use two cores fully)."""
    return max(1, min(2, os.cpu_count() or 1))


def _job_cost(job: RunJob) -> float:
    """A rough relative cost, to start the longest runs first (the last worker to finish sets the wall time)."""
    depth = 1.0 if job.arch == "standard" else 2.3
    return job.settings["max_steps"] * job.settings.get("max_length", 160) * depth


_WORKER_STARTED = False  # whether this process has run a job yet (its first carries the start-up CPU time)


def run_job(job: RunJob) -> dict:
    """One run, in a worker: post-train, evaluate on the held-out file, remove the checkpoint unless `keep`.
    Returns `evaluate`'s result with the training summary under "training" and the process CPU seconds per phase
    under "cpu_seconds" (startup, train, evaluate)."""
    global _WORKER_STARTED
    set_threads(job.threads)
    t0 = time.perf_counter()
    # Process CPU time per phase (load-independent, unlike wall time on a shared machine); the first job of a
    # process also carries the process's start-up (what it imported before this job; an import made later, such as
    # TRL's on the first training, falls into that phase).
    c0 = time.process_time()
    cpu = {"startup": 0.0 if _WORKER_STARTED else c0}
    _WORKER_STARTED = True
    train_one(job.base, job.arch, job.train_file, job.ckpt, job.settings, job.seed, job.max_iterations, job.model)
    c1 = time.process_time()
    if job.task_run is None:
        r = evaluate(job.ckpt, examples=load_examples(job.heldout), batch_size=job.batch_size,
                     max_new_tokens=job.max_new_tokens, progress=False, decider_accuracy=job.decider_accuracy,
                     name=job.name)
    else:  # scored exactly as `hf-loops eval CKPT --task NAME --json` scores it
        rows = job.task_run.rows()
        examples = job.task_run.examples(rows)
        r = evaluate(job.ckpt, examples=examples, dataset=job.task_run.describe(), split=job.task_run.split,
                     batch_size=job.batch_size, max_new_tokens=job.max_new_tokens, progress=False,
                     decider_accuracy=job.decider_accuracy, name=job.name,
                     answer_pattern=job.task_run.answer_pattern, token_accuracy=True)
        r["summary"] = task_summary(job.ckpt, r, job.task_run, rows, examples)
    cpu.update(train=c1 - c0, evaluate=time.process_time() - c1)
    r["cpu_seconds"] = cpu
    if not job.keep:
        shutil.rmtree(job.ckpt)
    print(f"[demo] {job.task} seed {job.seed}: {job.arch} done ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return r


def run_jobs(jobs: list, workers: int | None = None, fn=None) -> list[dict]:
    """`fn` (default `run_job`) over `jobs` (results in the order given), longest first, on `workers` processes (1:
    in this process). Runs are independent (each has its own seed, output folder and threads), so the order and the
    worker a run lands on do not change its numbers; only its wall time, which the report says. A job needs `arch`
    and `settings["max_steps"]` (its cost); `fn` must be importable by name (it travels to spawned workers)."""
    fn = run_job if fn is None else fn
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    order = sorted(range(len(jobs)), key=lambda i: -_job_cost(jobs[i]))
    results: list[dict | None] = [None] * len(jobs)
    if workers == 1 or len(jobs) == 1:
        for i in order:
            results[i] = fn(jobs[i])
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked child inherits torch's thread pools in whatever state the parent left them
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {i: pool.submit(fn, jobs[i]) for i in order}
        for i, f in futures.items():
            results[i] = f.result()
    return results


__all__ = ["default_workers", "float32_base", "run_job", "run_jobs", "train_one"]
