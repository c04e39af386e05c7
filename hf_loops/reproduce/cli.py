"""`hf-loops reproduce NAME [--seeds N] [--out DIR] [--quick]`: a paper's headline claim, trained and tested at CPU
scale (`hf_loops.reproduce`); writes OUT/summary.json, OUT/report.md and the pictures, prints the tables and whether
each claim held."""

from __future__ import annotations

from ..core.numbers import check_int
from ..evaluation.cli import set_threads
from ..evaluation.report import console_table
from . import NAMES

VERDICTS = {True: "held", False: "did not hold", None: "not measurable"}


def add_arguments(p) -> None:
    p.add_argument("name", choices=NAMES, help="the paper: spiralformer, sgt or analysis (the mechanistic analysis)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arch (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--out", default=None, help="output directory (default: reproduce_out/NAME)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quick", action="store_true",
                   help="a tiny smoke run (a few steps of a tiny model; what the tests run): its numbers are no result")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the recipe's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs side by side, one process each (default: one per CPU core, at most 2)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def main(args) -> int:
    from .analysis import run_analysis
    from .sgt import run_sgt
    from .spiralformer import run_spiralformer

    set_threads(1)
    check_int("--seeds", args.seeds, 1)
    check_int("--seed", args.seed, 0)
    if args.workers is not None:
        check_int("--workers", args.workers, 1)
    out = args.out or f"reproduce_out/{args.name}"
    run = {"spiralformer": run_spiralformer, "sgt": run_sgt, "analysis": run_analysis}[args.name]
    res = run(out, seeds=range(args.seed, args.seed + args.seeds), quick=args.quick, overwrite=args.overwrite,
              workers=args.workers, steps=args.steps, lr=args.lr)
    for t in res["tables"]:
        print(console_table(*t))
        print()
    print("the paper's claims, tested:")
    for name, ok, text in res["claims"]:
        print(f"  {VERDICTS[ok]}: {name} ({text})")
    print(f"\nwrote {res['out']} ({res['files']}) in {res['seconds']:.0f} s")
    return 0


__all__ = ["add_arguments", "main"]
