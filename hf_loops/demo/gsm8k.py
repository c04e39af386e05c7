"""The demo's question/answer pipeline (`run_demo`): the dataset split into post-training and held-out rows, Standard
and TaH2 post-trained from the base over seeds and evaluated on the held-out rows (with the arithmetic task's runs in
the same pool of workers when asked), then OUT/: report.md, eval.json, the pictures, the first seed's checkpoints and
the data split."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time

from ..core.numbers import check_int
from ..core.outdir import check_output_dir
from ..core.readers import read_jsonl
from ..data.arithmetic import class_deep_shares
from ..evaluation.examples import load_examples, looks_like_path, parse_split
from ..evaluation.metrics import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS
from ..evaluation.report import comparison_rows, console_table, output_dir, write_pictures
from .arithmetic_task import arithmetic_part
from .report import build_report
from .runs import default_workers, float32_base, run_jobs
from .settings import DEMO_HELDOUT, DEMO_TRAINING, RUNS, ArithmeticOptions, RunJob
from .stats import aggregate, cpu_summary, seed_table


# ----------------------------------------------------------------------------------------------------- data
def _default_data() -> tuple[str, str, list[int] | None]:
    """(base dir, dataset file, held-out row indices) of the embedded defaults."""
    from .. import data

    return data.default_base_dir(), data.gsm8k_path(), list(data.EVAL_ROWS)


def split_rows(rows: list, heldout: int, heldout_rows: list[int] | None = None) -> tuple[list, list]:
    """(train, held out): `heldout_rows` if given, else the last `heldout` rows."""
    if heldout_rows is None:
        if not 0 < heldout < len(rows):
            raise ValueError(f"--heldout must be in [1, {len(rows) - 1}] for a dataset of {len(rows)} rows, "
                             f"got {heldout}")
        heldout_rows = list(range(len(rows) - heldout, len(rows)))
    held = set(heldout_rows)
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in heldout_rows]


def _write_jsonl(path: str, rows: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _dataset_rows(spec: str, split: str | None) -> list[dict]:
    """Rows as written to the demo's data files: local rows as they are, Hub rows as prompt/completion."""
    if os.path.isfile(spec):
        _, a, b = parse_split(split)
        rows = read_jsonl(spec, "--dataset")[0][a:b]
        load_examples(spec, split)  # validates every row's fields with a line-accurate message
        return rows
    return [{"prompt": ex.prompt, "completion": ex.completion} for ex in load_examples(spec, split)]


# ----------------------------------------------------------------------------------------------------- pipeline
def run_demo(base: str | None = None, dataset: str | None = None, out: str = "demo_out", overwrite: bool = False,
             split: str | None = None, heldout: int = DEMO_HELDOUT, steps: int | None = None,
             max_iterations: int = 2, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, training: dict | None = None,
             progress: bool = True, command: str = "hf-loops demo", seeds=None, workers: int | None = None,
             arithmetic: ArithmeticOptions | None = None) -> dict:
    """The whole pipeline; returns {"results", "summaries", "table", "seed_table", "out", "seconds"}.

    `seeds` (default: `seed` alone): Standard and TaH2 are trained once per seed; the first seed's checkpoints,
    eval.json and pictures are kept, the seed table gives mean ± std over all of them. `arithmetic`: the arithmetic
    task's part (`arithmetic_task.arithmetic_part`); its runs share this run's workers and write `out/arithmetic/`."""
    t_start = time.perf_counter()
    check_output_dir(out, "--out", overwrite=overwrite, hint=" (pass --overwrite to replace it)")
    # every number is checked before the first training starts (not after both, inside evaluate)
    check_int("--max-new-tokens", max_new_tokens, 1)
    check_int("--batch-size", batch_size, 1)
    check_int("--heldout", heldout, 1)
    seeds = (seed,) if seeds is None else tuple(seeds)
    if not seeds:
        raise ValueError("--seeds must be >= 1")
    default_base, default_data, default_heldout = _default_data()
    heldout_rows = default_heldout if dataset is None else None
    base = base or default_base
    dataset = dataset or default_data
    if looks_like_path(base) and not os.path.isdir(base):
        raise ValueError(f"--base {base!r}: no such directory")
    if os.path.isdir(base) and not os.path.isfile(os.path.join(base, "config.json")):
        raise ValueError(f"--base {base!r} has no config.json (for the embedded base: is hf_loops/data/base "
                         "installed?)")
    settings = {**DEMO_TRAINING, **({} if progress else {"disable_tqdm": True}), **(training or {})}
    if steps is not None:
        settings["max_steps"] = check_int("--steps", steps, 1)
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 2:
        raise ValueError(f"--max-iterations must be an integer >= 2 for the TaH2 run, got {max_iterations!r}")
    workers = default_workers() if workers is None else check_int("--workers", workers, 1)

    rows = _dataset_rows(dataset, split)
    train_rows, held_rows = split_rows(rows, heldout, heldout_rows)
    out_abs = os.path.abspath(out)
    with output_dir(out, overwrite, "--out") as tmp:
        os.makedirs(os.path.join(tmp, "data"))
        train_file = os.path.join(tmp, "data", "train.jsonl")
        held_file = os.path.join(tmp, "data", "heldout.jsonl")
        _write_jsonl(train_file, train_rows)
        _write_jsonl(held_file, held_rows)
        base32 = float32_base(base, os.path.join(tmp, "base_fp32"))
        jobs = [_gsm8k_job(tmp, base32, key, s, s == seeds[0], settings, train_file, held_file, batch_size,
                           max_new_tokens, max_iterations) for s in seeds for key, _ in RUNS]
        extra, finish = arithmetic_part(os.path.join(tmp, "arithmetic"), base32, arithmetic) if arithmetic \
            else ([], None)
        print(f"[demo] {len(jobs) + len(extra)} runs ({settings['max_steps']} GSM8K steps on {len(train_rows)} "
              f"problems{', and the arithmetic task' if extra else ''}) on {min(workers, len(jobs) + len(extra))} "
              "worker(s)", flush=True)
        done = run_jobs(jobs + extra, workers)
        arith = finish(done[len(jobs):]) if finish else None
        shutil.rmtree(base32)
        if os.path.isdir(os.path.join(tmp, "runs")):
            shutil.rmtree(os.path.join(tmp, "runs"))
        results = done[:len(RUNS)]  # the first seed: its checkpoints stay in OUT/standard, OUT/tah2
        for (key, _), r in zip(RUNS, results, strict=True):
            r["model"] = os.path.join(out_abs, key)
        summaries = {key: r["training"] for (key, _), r in zip(RUNS, results, strict=True)}
        seed_runs = {}
        for job, r in zip(jobs, done[:len(jobs)], strict=True):
            seed_runs.setdefault(job.arch, []).append({
                "seed": job.seed, "metrics": r["metrics"], "train_runtime": r["training"]["train_runtime"],
                "class_shares": class_deep_shares(r["examples"]), "cpu_seconds": r.get("cpu_seconds")})
        seed_agg = aggregate(seed_runs)
        table_of_seeds = seed_table(seed_agg)
        seconds = time.perf_counter() - t_start
        rel = os.path.relpath(out_abs)
        eval_command = (f"hf-loops eval {rel}/tah2 --baseline {rel}/standard --dataset {rel}/data/heldout.jsonl "
                        f"--max-new-tokens {max_new_tokens} --batch-size {batch_size} --out {rel}_eval")
        info = {"command": command, "seconds": seconds, "base": base, "dataset": dataset,
                "train_rows": len(train_rows), "heldout_rows": len(held_rows), "eval_command": eval_command,
                "machine": f"{os.cpu_count()} CPU cores visible, {min(workers, len(jobs) + len(extra))} worker "
                           f"process(es) at torch threads 1, {platform.machine()}",
                "seeds": seeds, "seed_table": table_of_seeds, "arithmetic": arith, "cpu_seconds": cpu_summary(seed_runs)}
        write_pictures(results, tmp)
        with open(os.path.join(tmp, "eval.json"), "w", encoding="utf-8") as f:
            json.dump({"command": command, "results": results, "seeds": list(seeds), "seed_runs": seed_agg,
                       "cpu_seconds": cpu_summary(seed_runs)}, f, indent=1)
        with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
            f.write(build_report(results, summaries, info))
        headers, table_rows = comparison_rows(results)
        table = console_table(headers, table_rows)
    return {"results": results, "summaries": summaries, "table": table, "seed_table": table_of_seeds, "out": out_abs,
            "seconds": time.perf_counter() - t_start, "eval_command": eval_command, "arithmetic": arith}


def _gsm8k_job(tmp, base32, key, seed, first, settings, train_file, held_file, batch_size, max_new_tokens,
               max_iterations) -> RunJob:
    """One GSM8K run for `run_jobs`; the first seed's checkpoint is kept (OUT/standard, OUT/tah2)."""
    return RunJob(task="gsm8k", base=base32, arch=key, seed=seed, settings=settings, train_file=train_file,
                  heldout=held_file, batch_size=batch_size, max_new_tokens=max_new_tokens,
                  max_iterations=max_iterations if key == "tah2" else None,
                  ckpt=os.path.join(tmp, key) if first else os.path.join(tmp, "runs", f"{key}_seed{seed}"),
                  keep=first, decider_accuracy=first)


__all__ = ["run_demo", "split_rows"]
