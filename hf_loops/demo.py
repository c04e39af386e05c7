"""`hf-loops demo` (`make demo`): the main job, end to end, offline, on the embedded base.

Default (`--task both`), one pool of worker processes (`--workers`, one per core, at most 2) for every run:
1. the arithmetic task (`hf_loops.demo_tasks`): Standard, TaH2 and TaH2-fixed on seeded GSM8K-formatted calculator
   chains, `--seeds` seeds each, evaluated on a held-out split → OUT/arithmetic/;
2. GSM8K: the vendored 100 problems split 80 train / 20 held out (the held-out answers were never seen by the base);
   the embedded tiny Qwen3 base post-trained through `TaH2SFTTrainer` with the same settings and steps as Standard
   (M = 1) and TaH2 (M = 2, lookahead depth supervision), `--seeds` seeds each, evaluated with
   `hf_loops.evaluation.evaluate` (what `hf-loops eval` runs);
3. the tables (mean ± std over seeds; the first seed of GSM8K in detail) and `OUT/`: report.md, eval.json,
   depth_map.html/.png, loss_curves.png, depth_by_token_class.png, the first seed's two checkpoints, the data split.

`hf-loops demo --base DIR_OR_HUB_ID --dataset FILE_OR_HUB_ID` runs the GSM8K pipeline on any Qwen3(-Base) checkpoint and
question/answer dataset (the last `--heldout` rows are held out). `hf-loops demo --random` is the old walk-through: a
tiny random Qwen3 converted to TaH2, generating a few tokens with their depths (no training).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time

from .core.errors import run_command
from .core.numbers import check_float, check_int, or_default
from .core.outdir import check_output_dir
from .core.readers import read_jsonl
from .data.arithmetic import class_deep_shares
from .demo_tasks import (
    ARITHMETIC_TRAINING,
    DEMO_TRAINING,
    aggregate,
    arch_label,
    arithmetic_part,
    cpu_summary,
    default_workers,
    float32_base,
    run_arithmetic_demo,
    run_jobs,
    train_one,  # noqa: F401  (examples/ import it from here)
)
from .demo_tasks import (
    table as seed_stats_table,
)
from .evaluation.cli import set_threads
from .evaluation.examples import load_examples
from .evaluation.metrics import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS
from .evaluation.report import (
    comparison_rows,
    console_table,
    depth_rows,
    details_markdown,
    markdown_table,
    output_dir,
    write_pictures,
)

DEMO_HELDOUT = 20
# the held-out reference answers are 52-248 tokens long: 192 leaves room for most of them
DEMO_MAX_NEW_TOKENS = DEFAULT_MAX_NEW_TOKENS
RUNS = (("standard", arch_label("standard")), ("tah2", arch_label("tah2")))
DEMO_TASKS = ("both", "arithmetic", "gsm8k")
PAPER_SCALE = (
    "The paper's gains (+2.9 to +4.8 average accuracy points over Standard at 1.21-2.37x decode FLOPs per token) come "
    "from Qwen3-1.7B/4B/8B-Base post-trained on about 273k reasoning and tool-use samples (3 epochs, about 3.4B tokens, "
    "6,402 steps of 128 sequences up to 16k tokens) and evaluated on AIME, AMC, MATH500, OlympiadBench, HumanEval, MBPP, "
    "GPQA and BFCL."
)


# ----------------------------------------------------------------------------------------------------- data
def _default_data() -> tuple[str, str, list[int] | None]:
    """(base dir, dataset file, held-out row indices) of the embedded defaults."""
    from . import data

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
        from .evaluation.examples import parse_split

        _, a, b = parse_split(split)
        rows = read_jsonl(spec, "--dataset")[0][a:b]
        load_examples(spec, split)  # validates every row's fields with a line-accurate message
        return rows
    return [{"prompt": ex.prompt, "completion": ex.completion} for ex in load_examples(spec, split)]


# ----------------------------------------------------------------------------------------------------- training
# ----------------------------------------------------------------------------------------------------- report
def _verdict(std: dict, tah: dict) -> list[str]:
    s, t = std["metrics"], tah["metrics"]
    lines = []
    d_nll = t["answer_nll"] - s["answer_nll"]
    if d_nll < 0:
        lines.append(f"- **Answer NLL:** TaH2 is lower by {-d_nll:.3f} nats/token ({t['answer_nll']:.3f} vs "
                     f"{s['answer_nll']:.3f}) — the first seed, {t['examples']} problems, so no significance is claimed.")
    else:
        lines.append(f"- **Answer NLL:** TaH2 does **not** beat Standard: {t['answer_nll']:.3f} vs "
                     f"{s['answer_nll']:.3f} nats/token (+{d_nll:.3f}).")
    if t["correct"] > s["correct"]:
        lines.append(f"- **Exact match:** TaH2 {t['correct']}/{t['examples']} vs Standard "
                     f"{s['correct']}/{s['examples']}.")
    elif t["correct"] == s["correct"]:
        lines.append(f"- **Exact match:** a tie, {t['correct']}/{t['examples']} each"
                     + (" — at this scale neither model solves GSM8K problems it has not seen." if t["correct"] == 0
                        else "."))
    else:
        lines.append(f"- **Exact match:** TaH2 does **not** beat Standard: {t['correct']}/{t['examples']} vs "
                     f"{s['correct']}/{s['examples']}.")
    return lines


def build_report(results: list[dict], summaries: dict, info: dict) -> str:
    std, tah = results
    headers, rows = comparison_rows(results)
    t = tah["metrics"]
    ds = t.get("deep_share") or {}
    train_acc = summaries["tah2"].get("decider_acc")
    held_acc = (t.get("decider_accuracy") or {}).get("1")
    cont = (t.get("continue_rate") or {}).get("1")
    seeds = info.get("seeds") or (summaries["standard"]["settings"]["seed"],)
    arith = info.get("arithmetic")
    lines = [
        "# hf-loops demo: Standard vs TaH2" + (" on the arithmetic task and on held-out GSM8K" if arith else
                                               " on held-out GSM8K"),
        "",
        f"Command: `{info['command']}` — finished in **{info['seconds']:.0f} s** on {info['machine']}."
        + _cpu_line(info),
        "",
        *(_arithmetic_section(arith) if arith else []),
        "## GSM8K" if arith else "",
        "",
        f"Mean ± std over {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {info['heldout_rows']} held-out "
        "problems:",
        "",
        markdown_table(*info["seed_table"]) if info.get("seed_table") else "",
        "",
        f"The first seed ({seeds[0]}) in detail (its checkpoints are `standard/` and `tah2/`):",
        "",
        f"Base: `{info['base']}`. Data: `{info['dataset']}`, {info['train_rows']} problems for post-training, "
        f"{info['heldout_rows']} held out (`data/heldout.jsonl`). Both runs: the same "
        f"{summaries['standard']['steps']} `TaH2SFTTrainer` steps and settings (below); Standard = M = 1, "
        "TaH2 = M = 2 with lookahead depth supervision.",
        "",
        markdown_table(headers, rows),
        "",
        "Answer NLL: mean over the held-out reference answers' assistant tokens (teacher-forced). Exact match: greedy "
        f"generation (≤ {t['max_new_tokens']} new tokens), final `#### N` compared with the reference. Mean depth: "
        "passes that produced each reference-answer token (teacher-forced) and each generated token. Decode FLOPs: "
        "the paper's per-token FLOPs formulas (matmul FLOPs of each pass, `hf_loops.core.flops_tah2`, docs/tah2.md) "
        "over the generated tokens' measured depths. Training time: `train_runtime` of each run. Decider accuracy: "
        "against lookahead labels on the held-out answers.",
        "",
        "## What came out",
        "",
        *_verdict(std, tah),
        f"- **Depth:** TaH2's mean depth on the held-out answers is {t['mean_depth']:.3f} (continue rate after depth "
        f"1: {cont:.1%}); on its own generated tokens {t['mean_depth_generated']:.3f}."
        if t.get("mean_depth") is not None and cont is not None else "- **Depth:** not reported.",
        f"- **Where the depth goes:** share of deep tokens (2 passes) among digits/operators "
        f"{_pct(ds.get('digits/operators'))} vs words {_pct(ds.get('words'))}{_compare(ds)}.",
        f"- **Decider accuracy** (continue/stop vs lookahead labels): {_pct(train_acc)} during training (mean of the "
        f"last {summaries['tah2'].get('decider_acc_window')} logged steps), {_pct(held_acc)} on the held-out answers.",
        f"- **Cost:** decode FLOPs per token {rows[1][5]} of Standard; training time {rows[1][6]} of Standard "
        "(main forward + lookahead pass).",
        "",
        "**Settings.** Both runs share every setting (below). One departs from the paper: the decider loss weight "
        "α_D = 1.0 instead of 0.05 — with 0.05 the fresh updater's poor depth-2 predictions drive every decision to "
        "stop within two steps at this scale (mean depth 1.000 from step 3 on), so TaH2 would be Standard with extra "
        "cost. α_D does not touch the Standard run.",
        "",
        "**Scale.** This is a tiny base model post-trained for a few dozen steps on 80 problems: a test that the "
        "whole pipeline works and a look at where the decider spends depth, not a reproduction of the paper. "
        + PAPER_SCALE,
        "",
        "## Pictures",
        "",
        "![per-token depth](depth_map.png)",
        "",
        "`depth_map.html`: every held-out answer, each token coloured by its depth; hover a token for its depth and "
        "continue probability.",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "![mean depth by token class](depth_by_token_class.png)",
        "",
        "## Details",
        "",
        *(details_markdown(r) + "\n" for r in results),
        "## Settings",
        "",
        "```json",
        json.dumps(summaries["standard"]["settings"], indent=1),
        "```",
        "",
        "## Reproduce the table with `hf-loops eval`",
        "",
        "```bash",
        info["eval_command"],
        "```",
    ]
    return "\n".join(lines) + "\n"


def _cpu_line(info: dict) -> str:
    """The runs' process CPU seconds (every worker, load-independent), per task."""
    parts = [f"{name} {cpu['total']:.0f} s" for name, cpu in (
        ("arithmetic", (info.get("arithmetic") or {}).get("cpu_seconds")), ("GSM8K", info.get("cpu_seconds"))) if cpu]
    return f" Process CPU time of the runs: {', '.join(parts)}." if parts else ""


def _arithmetic_section(arith: dict) -> list[str]:
    """The arithmetic task's table, verdict and depth shares at the top of the combined report."""
    from .demo_tasks import verdict

    return [
        "## The arithmetic task (`arithmetic/report.md`)",
        "",
        "The claim tested (the paper's): a learned decider that gives extra depth only to the tokens that need it "
        "matches or beats Standard at a fraction of fixed depth's extra cost.",
        "",
        markdown_table(*arith["table"]),
        "",
        *verdict(arith["aggregate"]),
        "",
        "TaH2's share of deep tokens per class (held-out answers, teacher-forced):",
        "",
        markdown_table(*arith["class_table"]),
        "",
        "![deep share by class](arithmetic/deep_share_by_class.png) ![exact match vs decode FLOPs]"
        "(arithmetic/em_vs_flops.png)",
        "",
        "![per-token depth, arithmetic](arithmetic/depth_map.png)",
        "",
    ]


def _compare(ds: dict) -> str:
    a, b = ds.get("digits/operators"), ds.get("words")
    if a is None or b is None or a == b:
        return ""
    return (": the decider spends more depth on digits and operators than on words" if a > b
            else ": the decider spends more depth on words than on digits and operators")


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1%}"


# ----------------------------------------------------------------------------------------------------- pipeline
def run_demo(base: str | None = None, dataset: str | None = None, out: str = "demo_out", overwrite: bool = False,
             split: str | None = None, heldout: int = DEMO_HELDOUT, steps: int | None = None,
             max_iterations: int = 2, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0, training: dict | None = None,
             progress: bool = True, command: str = "hf-loops demo", seeds=None, workers: int | None = None,
             arithmetic: dict | None = None) -> dict:
    """The whole pipeline; returns {"results", "summaries", "table", "seed_table", "out", "seconds"}.

    `seeds` (default: `seed` alone): Standard and TaH2 are trained once per seed; the first seed's checkpoints,
    eval.json and pictures are kept, the seed table gives mean ± std over all of them. `arithmetic`: keyword
    arguments of `demo_tasks.arithmetic_part`; its runs share this run's workers and write `out/arithmetic/`."""
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
    from .evaluation.examples import looks_like_path

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
        extra, finish = arithmetic_part(os.path.join(tmp, "arithmetic"), base32, **arithmetic) if arithmetic \
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
            seed_runs.setdefault(job["arch"], []).append({
                "seed": job["seed"], "metrics": r["metrics"], "train_runtime": r["training"]["train_runtime"],
                "class_shares": class_deep_shares(r["examples"]), "cpu_seconds": r.get("cpu_seconds")})
        seed_agg = aggregate(seed_runs)
        seed_table = seed_stats_table(seed_agg)
        seconds = time.perf_counter() - t_start
        rel = os.path.relpath(out_abs)
        eval_command = (f"hf-loops eval {rel}/tah2 --baseline {rel}/standard --dataset {rel}/data/heldout.jsonl "
                        f"--max-new-tokens {max_new_tokens} --batch-size {batch_size} --out {rel}_eval")
        info = {"command": command, "seconds": seconds, "base": base, "dataset": dataset,
                "train_rows": len(train_rows), "heldout_rows": len(held_rows), "eval_command": eval_command,
                "machine": f"{os.cpu_count()} CPU cores visible, {min(workers, len(jobs) + len(extra))} worker "
                           f"process(es) at torch threads 1, {platform.machine()}",
                "seeds": seeds, "seed_table": seed_table, "arithmetic": arith, "cpu_seconds": cpu_summary(seed_runs)}
        write_pictures(results, tmp)
        with open(os.path.join(tmp, "eval.json"), "w", encoding="utf-8") as f:
            json.dump({"command": command, "results": results, "seeds": list(seeds), "seed_runs": seed_agg,
                       "cpu_seconds": cpu_summary(seed_runs)}, f, indent=1)
        with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
            f.write(build_report(results, summaries, info))
        headers, table_rows = comparison_rows(results)
        table = console_table(headers, table_rows)
    return {"results": results, "summaries": summaries, "table": table, "seed_table": seed_table, "out": out_abs,
            "seconds": time.perf_counter() - t_start, "eval_command": eval_command, "arithmetic": arith}


def _gsm8k_job(tmp, base32, key, seed, first, settings, train_file, held_file, batch_size, max_new_tokens,
               max_iterations) -> dict:
    """One GSM8K run for `run_jobs`; the first seed's checkpoint is kept (OUT/standard, OUT/tah2)."""
    return {"task": "gsm8k", "base": base32, "arch": key, "seed": seed, "settings": settings,
            "train_file": train_file, "heldout": held_file, "batch_size": batch_size,
            "max_new_tokens": max_new_tokens, "max_iterations": max_iterations if key == "tah2" else None,
            "ckpt": os.path.join(tmp, key) if first else os.path.join(tmp, "runs", f"{key}_seed{seed}"),
            "keep": first, "decider_accuracy": first}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------------- random
def random_walkthrough(prompt: str, max_new_tokens: int = 16, max_iterations: int = 3, exit_threshold: float = 0.5,
                       tokenizer: str | None = None, seed: int = 0) -> None:
    """Tiny random Qwen3 → TaH2, generate, print every token with its depth (no training, no data)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .conversion import convert_qwen3
    from .inference import generate_with_depths

    torch.manual_seed(seed)
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        vocab, encode, decode = len(tok), tok.encode, tok.decode
    else:  # bytes as tokens: no tokenizer files needed
        vocab = 256
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
        decode = lambda ids: bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    model = convert_qwen3(qwen, "tah2", max_iterations=max_iterations, exit_threshold=exit_threshold).eval()
    if model.decider is not None:  # an untrained decider sits at g ≈ 0.5; spread it so the walk-through shows depths
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, 2.0)
    trace = generate_with_depths(model, torch.tensor([encode(prompt)]), max_new_tokens=max_new_tokens)
    print(f"tiny random Qwen3 → TaH2 (M={max_iterations}, τ={exit_threshold}); prompt: {prompt!r}")
    print(f"prompt depths: {trace.prompt_depths}")
    print(f"{'step':>4}  {'token':>6}  depth  text")
    for i, (t, d) in enumerate(zip(trace.tokens, trace.depths, strict=True)):
        print(f"{i:>4}  {t:>6}  {d:>5}  {decode([t])!r}")
    mean = sum(trace.depths) / max(len(trace.depths), 1)
    print(f"mean depth over {len(trace.depths)} generated tokens: {mean:.2f}")


# ----------------------------------------------------------------------------------------------------- CLI
RANDOM_PROMPT = "Looped transformers think harder on hard tokens."


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None, help="Qwen3(-Base) directory or Hub id (default: the embedded base)")
    p.add_argument("--dataset", default=None,
                   help="question/answer .jsonl or Hub dataset id (default: the vendored 100 GSM8K problems)")
    p.add_argument("--split", default=None, help="NAME or NAME[start:stop] of --dataset")
    p.add_argument("--heldout", type=int, default=DEMO_HELDOUT, help="rows held out for evaluation (the last ones)")
    p.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per run, both tasks (default: arithmetic {ARITHMETIC_TRAINING['max_steps']}, "
                        f"GSM8K {DEMO_TRAINING['max_steps']})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"generation length at evaluation (default {DEMO_MAX_NEW_TOKENS}; --random: 16)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="evaluation batch size")
    p.add_argument("--max-iterations", type=int, default=None, help="M of the TaH2 run (default 2; --random: 3)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (the runs use --seeds seeds from it)")
    p.add_argument("--task", choices=DEMO_TASKS, default="both",
                   help="both (default, what make demo runs): the arithmetic task (Standard, TaH2, TaH2-fixed) and "
                        "the GSM8K run (Standard, TaH2), one pool of workers, the arithmetic part in OUT/arithmetic; "
                        "arithmetic / gsm8k: one of them. --base/--dataset: gsm8k only")
    p.add_argument("--seeds", type=int, default=3, help="seeds per run (default 3)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs side by side, one process each (default: one per CPU core, at most 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: at this model size more threads cost more than they save)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    r = p.add_argument_group("--random", "the old walk-through: a tiny random Qwen3 → TaH2, no training")
    r.add_argument("--random", action="store_true", help="run the random-weights walk-through instead")
    r.add_argument("--prompt", default=RANDOM_PROMPT)
    r.add_argument("--exit-threshold", type=float, default=0.5)
    r.add_argument("--tokenizer", default=None, help="tokenizer directory (default: bytes)")


def demo_command(args, argv: list[str] | None = None) -> int:
    if args.random:
        # None means "not given"; an explicit 0 is checked (and refused), never replaced by the default
        random_walkthrough(args.prompt, check_int("--max-new-tokens", or_default(args.max_new_tokens, 16), 1),
                           check_int("--max-iterations", or_default(args.max_iterations, 3), 1),
                           check_float("--exit-threshold", args.exit_threshold, 0, 1, low_open=True, high_open=True),
                           args.tokenizer, args.seed)
        return 0
    set_threads(args.threads)
    check_int("--seeds", args.seeds, 1)
    if args.workers is not None:
        check_int("--workers", args.workers, 1)
    seeds = tuple(range(args.seed, args.seed + args.seeds))
    task = getattr(args, "task", "gsm8k")
    if task != "gsm8k" and (args.base or args.dataset):
        if task == "arithmetic":
            raise ValueError("--task arithmetic runs on the embedded base and its own data: drop --base/--dataset")
        task = "gsm8k"  # a custom base or dataset: the question/answer pipeline only
    if task == "arithmetic":
        res = run_arithmetic_demo(args.out, overwrite=args.overwrite, seeds=seeds, steps=args.steps,
                                  progress=not args.no_progress, workers=args.workers)
        _print_arithmetic(res)
        print(f"\nwrote {res['out']} (report.md, runs.json, em_vs_flops.png, deep_share_by_class.png, "
              f"depth_map.png) in {res['seconds']:.0f} s")
        return 0
    arithmetic = ({"seeds": seeds, "steps": args.steps, "progress": not args.no_progress} if task == "both"
                  else None)
    command = "hf-loops demo" + ("" if not argv else " " + shlex.join(argv))
    result = run_demo(base=args.base, dataset=args.dataset, out=args.out, overwrite=args.overwrite, split=args.split,
                      heldout=args.heldout, steps=args.steps, max_iterations=or_default(args.max_iterations, 2),
                      max_new_tokens=or_default(args.max_new_tokens, DEMO_MAX_NEW_TOKENS), batch_size=args.batch_size,
                      seed=args.seed, progress=not args.no_progress, command=command, seeds=seeds,
                      workers=args.workers, arithmetic=arithmetic)
    if result["arithmetic"]:
        _print_arithmetic(result["arithmetic"])
    tah = result["results"][1]
    if tah["metrics"].get("mean_depth") is not None and sys.stdout.isatty():
        from .analysis.depth_map import render_ansi

        print(render_ansi(depth_rows(tah, limit=1), tah["metrics"]["max_iterations"]))
    print(f"\nGSM8K, held out (mean ± std over {len(seeds)} seed(s)):")
    print(console_table(*result["seed_table"]))
    print(f"\nGSM8K, seed {seeds[0]} (checkpoints in OUT/standard, OUT/tah2):")
    print(result["table"])
    print(f"\nwrote {result['out']} (report.md, depth_map.html, depth_map.png, loss_curves.png, "
          f"depth_by_token_class.png{', arithmetic/' if result['arithmetic'] else ''}) in {result['seconds']:.0f} s")
    print(f"reproduce the seed-{seeds[0]} table: {result['eval_command']}")
    return 0


def _print_arithmetic(res: dict) -> None:
    print("\narithmetic task, held out (mean ± std over seeds):")
    print(console_table(*res["table"]))
    print("\nTaH2's deep tokens per class (teacher-forced held-out answers):")
    print(console_table(*res["class_table"]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="hf-loops demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_arguments(p)
    args = p.parse_args(argv)
    return run_command(demo_command, args, argv, debug=args.debug)


__all__ = ["DEMO_TRAINING", "add_demo_arguments", "demo_command", "random_walkthrough", "run_demo", "split_rows"]
