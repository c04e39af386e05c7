"""`hf-loops eval`: evaluate a checkpoint (TaH2, SpiralFormer, SGT or plain Qwen3) on a question/answer dataset.

    hf-loops eval CHECKPOINT [--baseline CHECKPOINT] --dataset FILE_OR_HUB_ID [--split NAME[a:b]]
                  [--max-new-tokens N] [--batch-size B] [--answer-pattern gsm8k|last-number|REGEX] --out DIR

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
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..core.errors import run_command
from ..core.numbers import check_float, check_int
from ..core.outdir import check_output_dir
from .examples import answer_regex, load_examples
from .metrics import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS, evaluate
from .models import check_checkpoint_path
from .report import output_dir, write_eval


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model directory or Hub id (TaH2, SpiralFormer, SGT or Qwen3)")
    p.add_argument("--baseline", default=None, help="a second checkpoint evaluated the same way; ratios are ÷ it")
    p.add_argument("--dataset", required=True, help="local .jsonl/.json or Hub dataset id (question/answer, "
                                                    "prompt/completion or messages)")
    p.add_argument("--split", default=None, help="NAME or NAME[start:stop] (default: train, all rows)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--answer-pattern", default="gsm8k",
                   help="gsm8k (#### N), last-number, or a regex whose first group is the answer")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="extra stop string (repeatable)")
    p.add_argument("--max-iterations", type=int, default=None, help="TaH2: override M at evaluation")
    p.add_argument("--exit-threshold", type=float, default=None, help="TaH2: override τ at evaluation")
    p.add_argument("--no-decider-accuracy", action="store_true", help="skip the lookahead-label decider check")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: small models decode faster on one thread)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def set_threads(n: int | None) -> None:
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


def cmd_eval(args, argv: Sequence[str] | None = None) -> int:
    import shlex

    set_threads(args.threads)
    check_output_dir(args.out, "--out", overwrite=args.overwrite, hint=" (pass --overwrite to replace it)")
    check_int("--max-new-tokens", args.max_new_tokens, 1)
    check_int("--batch-size", args.batch_size, 1)
    if args.max_iterations is not None:
        check_int("--max-iterations", args.max_iterations, 1)
    if args.exit_threshold is not None:
        check_float("--exit-threshold", args.exit_threshold, 0, 1, low_open=True, high_open=True)
    answer_regex(args.answer_pattern)
    examples = load_examples(args.dataset, args.split)
    for ckpt in [args.checkpoint] + ([args.baseline] if args.baseline else []):
        check_checkpoint_path(ckpt)  # every checkpoint named is checked before the first is evaluated
    with output_dir(args.out, args.overwrite) as tmp:  # refuses a non-empty --out before any work
        results = []
        for i, ckpt in enumerate(([args.baseline] if args.baseline else []) + [args.checkpoint]):
            results.append(evaluate(ckpt, examples=examples, dataset=args.dataset, split=args.split,
                                    batch_size=args.batch_size,
                                    max_new_tokens=args.max_new_tokens, answer_pattern=args.answer_pattern,
                                    max_iterations=args.max_iterations, exit_threshold=args.exit_threshold,
                                    stop_strings=args.stop, decider_accuracy=not args.no_decider_accuracy,
                                    progress=not args.no_progress, baseline=bool(args.baseline) and i == 0))
        command = "hf-loops eval " + shlex.join(list(argv)) if argv is not None else None
        table = write_eval(results, tmp, command=command)
    print(table)
    print(f"wrote {os.path.abspath(args.out)} (eval.json, eval.md, pictures)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-loops eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    return run_command(cmd_eval, args, argv, debug=args.debug)




__all__ = ["add_eval_arguments", "cmd_eval", "set_threads"]
