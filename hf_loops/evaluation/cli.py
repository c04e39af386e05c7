"""`hf-loops eval`: evaluate a checkpoint (TaH2, SpiralFormer, SGT or plain Qwen3) on a question/answer dataset.

    hf-loops eval CHECKPOINT [--baseline CHECKPOINT] --dataset FILE_OR_HUB_ID [--split NAME[a:b]]
                  [--max-new-tokens N] [--batch-size B] [--answer-pattern gsm8k|last-number|REGEX] --out DIR
    hf-loops eval CHECKPOINT --task depth [--n K] [--data-seed N] [--digits D] [--nine-prob P] [--json] [--out DIR]
    hf-loops eval CHECKPOINT --task hop [--n K] [--data-seed N] [--n-sym S] [--n-queries Q] [--max-hops H] [--json]

Per model it measures, on the same examples:
- answer NLL and perplexity over the assistant (completion) tokens only, teacher-forced — the tokens TRL's SFT
  trains on (prompt rendered with the chat template and the generation prompt, completion = the rest);
- greedy-generation exact match of the extracted final answer (GSM8K `#### N` by default);
- for models that report per-token depth (TaH2): mean and histogram of the depth that produced every answer token,
  continue rate per iteration, mean depth per token class, the decider's accuracy against lookahead labels, and the
  mean depth of the generated tokens; a plain Qwen3 (what a Standard run saves) is one pass: depth 1 on every token;
- decode FLOPs per generated token from the architecture's FLOPs accounting (`hf_loops.core.flops_*`; the paper's App. A.4 for TaH2 and Qwen3) and
  measured tokens/s.

Batched with left padding; a batch gives the numbers of a per-row loop (tests check it). Outputs (JSON, markdown,
depth map HTML/PNG, depth-by-class and loss-curve PNGs) go to a new directory written atomically.
The same numbers from Python: `hf_loops.evaluation.evaluate(model_or_path, dataset=...)`.

`--task depth|hop` scores `--n` problems generated with `--data-seed` (`hf_loops.evaluation.tasks`) instead of a dataset;
`--json` prints one object: exact_match, answer_nll, mean_depth, generated_depth, decode_flops_ratio (÷ the Standard
formula's FLOPs at the same prompt and generated lengths), train_time_ratio (null: an evaluation cannot know it) and
by_difficulty (per difficulty level, carry reach or hops: teacher-forced argmax accuracy, share of depth >= 2 tokens,
tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from ..core.errors import run_command
from ..core.numbers import check_float, check_int, or_default
from ..core.outdir import check_output_dir
from .examples import answer_regex, load_examples
from .metrics import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS, evaluate
from .models import check_checkpoint_path
from .report import comparison_rows, console_table, output_dir, write_eval
from .tasks import TASKS, DepthTaskRun, depth_task_run, hop_task_run, task_summary


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model directory or Hub id (TaH2, SpiralFormer, SGT or Qwen3)")
    p.add_argument("--baseline", default=None, help="a second checkpoint evaluated the same way; ratios are ÷ it")
    p.add_argument("--dataset", default=None, help="local .jsonl/.json or Hub dataset id (question/answer, "
                                                   "prompt/completion or messages); required unless --task")
    p.add_argument("--split", default=None, help="NAME or NAME[start:stop] (default: train, all rows); with --task "
                                                 "depth: train, validation or test (default test)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"generation length (default {DEFAULT_MAX_NEW_TOKENS}; --task depth: the longest answer)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--answer-pattern", default="gsm8k",
                   help="gsm8k (#### N), last-number, or a regex whose first group is the answer")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="extra stop string (repeatable)")
    p.add_argument("--max-iterations", type=int, default=None, help="TaH2: override M at evaluation")
    p.add_argument("--exit-threshold", type=float, default=None, help="TaH2: override τ at evaluation")
    p.add_argument("--no-decider-accuracy", action="store_true", help="skip the lookahead-label decider check")
    p.add_argument("--out", default=None, help="output directory (must not exist or be empty); required unless "
                                               "--task (then optional)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: small models decode faster on one thread)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    t = p.add_argument_group("--task", "problems generated from a seed instead of --dataset")
    t.add_argument("--task", default=None, metavar="NAME",
                   help=f"one of: {', '.join(TASKS)}. depth = fixed-width addition labelled by carry reach "
                        "(hf_loops.data.depth_task); hop = k-hop lookup in an in-context permutation labelled by "
                        "hops (hf_loops.data.hop_task); scored like a dataset")
    t.add_argument("--n", type=int, default=None, help="problems to generate (default 100)")
    t.add_argument("--data-seed", type=int, default=None, help="seed of the generated problems (default 0)")
    t.add_argument("--digits", type=int, default=None, help="depth: operand digits, 2-8 (default 4)")
    t.add_argument("--nine-prob", type=float, default=None,
                   help="depth: probability that a column's digits sum to 9 (default 0.3)")
    t.add_argument("--n-sym", type=int, default=None, help="hop: letter pairs of the permutation, 3-26 (default 8)")
    t.add_argument("--n-queries", type=int, default=None, help="hop: queries per problem, 1..n-sym (default 4)")
    t.add_argument("--max-hops", type=int, default=None, help="hop: largest hop count (default 2)")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table: exact_match, answer_nll, mean_depth, "
                        "generated_depth, decode_flops_ratio (÷ the Standard formula at the same lengths), "
                        "train_time_ratio (always null: an evaluation cannot know how long training took) and "
                        "by_difficulty {level: {accuracy, deep_share, tokens}}")


TASK_FLAGS = (("--n", "n"), ("--data-seed", "data_seed"), ("--digits", "digits"), ("--nine-prob", "nine_prob"),
              ("--n-sym", "n_sym"), ("--n-queries", "n_queries"), ("--max-hops", "max_hops"))
# the flags of one task only
TASK_ONLY_FLAGS = {"depth": (("--digits", "digits"), ("--nine-prob", "nine_prob")),
                   "hop": (("--n-sym", "n_sym"), ("--n-queries", "n_queries"), ("--max-hops", "max_hops"))}


def set_threads(n: int | None) -> None:
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


def _task_run(args) -> DepthTaskRun | None:
    """The generated problems `--task` asks for (None: `--dataset`), every task flag checked."""
    task = getattr(args, "task", None)
    if task is None:
        given = [flag for flag, key in TASK_FLAGS if getattr(args, key, None) is not None]
        if getattr(args, "json", False):
            given.append("--json")
        if given:
            raise ValueError(f"{', '.join(given)}: only with --task ({', '.join(TASKS)})")
        if args.dataset is None:
            raise ValueError("--dataset is required (or --task depth|hop: generated problems)")
        if args.out is None:
            raise ValueError("--out is required with --dataset")
        return None
    if task not in TASKS:
        raise ValueError(f"--task must be one of: {', '.join(TASKS)}; got {task!r}")
    if args.dataset is not None:
        raise ValueError(f"--task {task} generates its problems: drop --dataset")
    if args.answer_pattern != "gsm8k":
        raise ValueError(f"--answer-pattern: --task {task} scores its own answer line (depth: #### N; hop: the whole "
                         "#### line)")
    if args.json and args.baseline:
        raise ValueError("--json reports one checkpoint: drop --baseline (or --json for the table)")
    for other, flags in TASK_ONLY_FLAGS.items():
        given = [flag for flag, key in flags if other != task and getattr(args, key, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --task {other}")
    if task == "hop":
        return hop_task_run(or_default(args.n, 100), or_default(args.data_seed, 0), or_default(args.n_sym, 8),
                            or_default(args.n_queries, 4), or_default(args.max_hops, 2),
                            or_default(args.split, "test"))
    return depth_task_run(or_default(args.n, 100), or_default(args.data_seed, 0), or_default(args.digits, 4),
                          or_default(args.nine_prob, 0.3), or_default(args.split, "test"))


def cmd_eval(args, argv: Sequence[str] | None = None) -> int:
    import shlex

    set_threads(args.threads)
    task = _task_run(args)
    if args.out is not None:
        check_output_dir(args.out, "--out", overwrite=args.overwrite, hint=" (pass --overwrite to replace it)")
    max_new_tokens = or_default(args.max_new_tokens, task.max_new_tokens() if task else DEFAULT_MAX_NEW_TOKENS)
    check_int("--max-new-tokens", max_new_tokens, 1)
    check_int("--batch-size", args.batch_size, 1)
    if args.max_iterations is not None:
        check_int("--max-iterations", args.max_iterations, 1)
    if args.exit_threshold is not None:
        check_float("--exit-threshold", args.exit_threshold, 0, 1, low_open=True, high_open=True)
    answer_regex(args.answer_pattern)
    rows = task.rows() if task else None
    examples = task.examples(rows) if task else load_examples(args.dataset, args.split)
    for ckpt in [args.checkpoint] + ([args.baseline] if args.baseline else []):
        check_checkpoint_path(ckpt)  # every checkpoint named is checked before the first is evaluated
    # refuses a non-empty --out before any work; without --out (a --task run) nothing is written
    with output_dir(args.out, args.overwrite) if args.out is not None else contextlib.nullcontext() as tmp:
        results = []
        for i, ckpt in enumerate(([args.baseline] if args.baseline else []) + [args.checkpoint]):
            results.append(evaluate(ckpt, examples=examples, dataset=task.describe() if task else args.dataset,
                                    split=task.split if task else args.split, batch_size=args.batch_size,
                                    max_new_tokens=max_new_tokens,
                                    answer_pattern=task.answer_pattern if task else args.answer_pattern,
                                    max_iterations=args.max_iterations, exit_threshold=args.exit_threshold,
                                    stop_strings=args.stop,
                                    decider_accuracy=not args.no_decider_accuracy and not args.json,
                                    progress=not args.no_progress, baseline=bool(args.baseline) and i == 0,
                                    token_accuracy=task is not None))
        command = "hf-loops eval " + shlex.join(list(argv)) if argv is not None else None
        table = write_eval(results, tmp, command=command) if tmp is not None else console_table(
            *comparison_rows(results))
        summary = task_summary(args.checkpoint, results[-1], task, rows, examples) if args.json else None
    if summary is not None:
        print(json.dumps(summary))
        return 0
    print(table)
    if args.out is not None:
        print(f"wrote {os.path.abspath(args.out)} (eval.json, eval.md, pictures)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-loops eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    return run_command(cmd_eval, args, argv, debug=args.debug)




__all__ = ["TASK_FLAGS", "add_eval_arguments", "cmd_eval", "set_threads"]
