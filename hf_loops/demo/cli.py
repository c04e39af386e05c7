"""`hf-loops demo` (`make demo`): the main job, end to end, offline, on an embedded base.

Default (`--task hop`, what `make demo` runs): the depth-bound k-hop lookup task (`hf_loops.demo.hop`): Standard, TaH2
and TaH2-fixed post-trained from the embedded 1-hop base (`hf_loops.data.hop_base_dir()`), `--seeds` seeds each, on
one pool of worker processes (`--workers`, one per core, at most 2), scored on the held-out test split as
`hf-loops eval CKPT --task hop --json` scores it → OUT/summary.json, OUT/report.md, OUT/hop/ (the seed-0 checkpoints,
runs.json, pictures).

`--task both`: the older pair of tasks on the embedded 3M base, one pool of workers for every run:
1. the arithmetic task (`hf_loops.demo.arithmetic_task`): Standard, TaH2 and TaH2-fixed on seeded GSM8K-formatted calculator
   chains, `--seeds` seeds each, evaluated on a held-out split → OUT/arithmetic/;
2. GSM8K: the vendored 100 problems split 80 train / 20 held out (the held-out answers were never seen by the base);
   the embedded tiny Qwen3 base post-trained through `TaH2SFTTrainer` with the same settings and steps as Standard
   (M = 1) and TaH2 (M = 2, lookahead depth supervision), `--seeds` seeds each, evaluated with
   `hf_loops.evaluation.metrics.evaluate` (what `hf-loops eval` runs);
3. the tables (mean ± std over seeds; the first seed of GSM8K in detail) and `OUT/`: report.md, eval.json,
   depth_map.html/.png, loss_curves.png, depth_by_token_class.png, the first seed's two checkpoints, the data split.

`hf-loops demo --base DIR_OR_HUB_ID --dataset FILE_OR_HUB_ID` runs the GSM8K pipeline on any Qwen3(-Base) checkpoint and
question/answer dataset (the last `--heldout` rows are held out). `hf-loops demo --random` is the old walk-through: a
tiny random Qwen3 converted to TaH2, generating a few tokens with their depths (no training).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..core.errors import run_command
from ..core.numbers import check_float, check_int, or_default
from ..evaluation.cli import set_threads
from ..evaluation.metrics import DEFAULT_BATCH_SIZE
from ..evaluation.report import console_table, depth_rows
from .arithmetic_task import run_arithmetic_demo
from .gsm8k import run_demo
from .hop import run_hop_demo
from .settings import (
    ARITHMETIC_TRAINING,
    DEMO_HELDOUT,
    DEMO_MAX_NEW_TOKENS,
    DEMO_TASKS,
    DEMO_TRAINING,
    HOP_EVAL_BATCH,
    HOP_SIZES,
    HOP_TRAINING,
    ArithmeticOptions,
    HopOptions,
)
from .walkthrough import RANDOM_PROMPT, random_walkthrough


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None, help="Qwen3(-Base) directory or Hub id (default: the embedded base)")
    p.add_argument("--dataset", default=None,
                   help="question/answer .jsonl or Hub dataset id (default: the vendored 100 GSM8K problems)")
    p.add_argument("--split", default=None, help="NAME or NAME[start:stop] of --dataset")
    p.add_argument("--heldout", type=int, default=None,
                   help=f"problems held out for evaluation (default: hop {HOP_SIZES['n_heldout']} test-split problems; "
                        f"GSM8K the last {DEMO_HELDOUT} rows)")
    p.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per run (default: hop {HOP_TRAINING['max_steps']}, arithmetic "
                        f"{ARITHMETIC_TRAINING['max_steps']}, GSM8K {DEMO_TRAINING['max_steps']})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"generation length at evaluation (default {DEMO_MAX_NEW_TOKENS}; --random: 16)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"evaluation batch size (default: hop {HOP_EVAL_BATCH}, GSM8K {DEFAULT_BATCH_SIZE})")
    p.add_argument("--max-iterations", type=int, default=None, help="M of the TaH2 run (default 2; --random: 3)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (the runs use --seeds seeds from it)")
    p.add_argument("--task", choices=DEMO_TASKS, default=None,
                   help="hop (default, what make demo runs): the depth-bound k-hop task from the embedded 1-hop base "
                        "(Standard, TaH2, TaH2-fixed); both: the arithmetic task (Standard, TaH2, TaH2-fixed) and "
                        "the GSM8K run (Standard, TaH2) on the embedded 3M base, one pool of workers, the arithmetic "
                        "part in OUT/arithmetic; arithmetic / gsm8k: one of them. --base/--dataset: gsm8k only (the default "
                        "task when either is given)")
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
    if task is None:  # a custom base or dataset: the question/answer pipeline; else the depth-bound task
        task = "gsm8k" if args.base or args.dataset else "hop"
    if task != "gsm8k" and (args.base or args.dataset):
        if task in ("arithmetic", "hop"):
            raise ValueError(f"--task {task} runs on its embedded base and its own data: drop --base/--dataset "
                             "(or pass --task gsm8k)")
        task = "gsm8k"  # a custom base or dataset: the question/answer pipeline only
    heldout = args.heldout
    if args.batch_size is not None:
        check_int("--batch-size", args.batch_size, 1)
    if task == "hop":
        if heldout is not None:
            check_int("--heldout", heldout, 1)
        for flag, value in (("--split", args.split), ("--max-iterations", args.max_iterations),
                            ("--max-new-tokens", args.max_new_tokens)):
            if value is not None:
                raise ValueError(f"{flag}: not with --task hop (its runs use M = 2 and the answer's length)")
        res = run_hop_demo(args.out, overwrite=args.overwrite, workers=args.workers,
                           options=HopOptions(seeds=seeds, steps=args.steps, progress=not args.no_progress,
                                              n_heldout=or_default(heldout, HOP_SIZES["n_heldout"]),
                                              batch_size=or_default(args.batch_size, HOP_EVAL_BATCH)))
        _print_hop(res)
        print(f"\nwrote {res['out']} (summary.json, report.md, hop/: the seed-{seeds[0]} checkpoints, runs.json, "
              f"accuracy_by_difficulty.png, deep_share_by_difficulty.png, depth_map.png) in {res['seconds']:.0f} s")
        print(f"check a checkpoint on fresh problems: hf-loops eval {args.out}/hop/tah2-seed{seeds[0]} --task hop "
              "--data-seed 1 --n 200 --json")
        return 0
    if task == "arithmetic":
        res = run_arithmetic_demo(args.out, overwrite=args.overwrite, seeds=seeds, steps=args.steps,
                                  progress=not args.no_progress, workers=args.workers)
        _print_arithmetic(res)
        print(f"\nwrote {res['out']} (report.md, runs.json, em_vs_flops.png, deep_share_by_class.png, "
              f"depth_map.png) in {res['seconds']:.0f} s")
        return 0
    arithmetic = (ArithmeticOptions(seeds=seeds, steps=args.steps, progress=not args.no_progress) if task == "both"
                  else None)
    command = "hf-loops demo" + ("" if not argv else " " + shlex.join(argv))
    result = run_demo(base=args.base, dataset=args.dataset, out=args.out, overwrite=args.overwrite, split=args.split,
                      heldout=or_default(heldout, DEMO_HELDOUT), steps=args.steps,
                      max_iterations=or_default(args.max_iterations, 2),
                      max_new_tokens=or_default(args.max_new_tokens, DEMO_MAX_NEW_TOKENS),
                      batch_size=or_default(args.batch_size, DEFAULT_BATCH_SIZE),
                      seed=args.seed, progress=not args.no_progress, command=command, seeds=seeds,
                      workers=args.workers, arithmetic=arithmetic)
    if result["arithmetic"]:
        _print_arithmetic(result["arithmetic"])
    tah = result["results"][1]
    if tah["metrics"].get("mean_depth") is not None and sys.stdout.isatty():
        from ..analysis.depth_map import render_ansi

        print(render_ansi(depth_rows(tah, limit=1), tah["metrics"]["max_iterations"]))
    print(f"\nGSM8K, held out (mean ± std over {len(seeds)} seed(s)):")
    print(console_table(*result["seed_table"]))
    print(f"\nGSM8K, seed {seeds[0]} (checkpoints in OUT/standard, OUT/tah2):")
    print(result["table"])
    print(f"\nwrote {result['out']} (report.md, depth_map.html, depth_map.png, loss_curves.png, "
          f"depth_by_token_class.png{', arithmetic/' if result['arithmetic'] else ''}) in {result['seconds']:.0f} s")
    print(f"reproduce the seed-{seeds[0]} table: {result['eval_command']}")
    return 0


def _print_hop(res: dict) -> None:
    print("\nhop task, held out (mean ± std over seeds):")
    print(console_table(*res["table"]))
    print("\nper difficulty (teacher-forced held-out answers):")
    print(console_table(*res["difficulty_table"]))
    print("\nthe claim, tested:")
    for name, ok, text in res["claims"]:
        print(f"  {'held' if ok else 'did not hold'}: {name} ({text})")


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


__all__ = ["add_demo_arguments", "demo_command"]
