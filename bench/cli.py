"""`python -m bench <group> [options]`: run a group of rows (or `all`), write JSON + markdown, print the table."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from . import compiled, kv_quant, quantized, spiral, tah2_decode, tah2_generate, train_memory, train_steps
from .common import SIZES, WORKLOADS, Ctx, set_clock
from .report import eprint, markdown, settings, write

GROUPS = {
    "tah2-decode": tah2_decode.rows,  # efficiency b1/b8, TaH2-fixed, depth ≈ 1.2, KV bytes at batch 8
    "tah2-generate": tah2_generate.rows,  # generate: continuous depth vs lockstep, b1/b8/b32, vs the FLOPs bound
    "train-steps": train_steps.rows,  # TaH2 SFT step, SGT and Block Loop train steps
    "train-memory": train_memory.rows,  # TaH2 SFT step peak memory ÷ Standard at vocabulary 151,936 (subprocesses)
    "spiral": spiral.rows,  # SpiralFormer-B prefill, core passes per decode token
    "quant": quantized.rows,  # int8 / int4 weight-only: NLL, depth kept, tokens/s ÷ fp32 and bf16 (CPU)
    "kv-quant": kv_quant.rows,  # int8 / int4 quantized loop cache: KV bytes ÷ fp32, greedy = fp cache (base)
    "compile": compiled.rows,  # torch.compile vs eager decode (subprocess with a time limit)
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("group", choices=["all", *GROUPS, "compile-worker"])
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--quick", action="store_true", help="tiny size, short sequences, 2 repeats (a smoke run)")
    p.add_argument("--sizes", default=None, help=f"comma list of {sorted(SIZES)}; default: tiny,100m on cpu "
                                                 "(tiny with --quick), 1.7b on cuda")
    p.add_argument("--rows", default="", help="comma list of row-id substrings to run, e.g. tah2-kv,spiral-core; "
                                             "a leading '-' drops, e.g. --rows=-compile")
    p.add_argument("--repeats", type=int, default=None, help="override the workload's best-of-N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: os.cpu_count())")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall (default) | cpu: process CPU time, for a CPU shared with other jobs (with --threads 1 it "
                        "leaves out the time slices other jobs get; cpu device only)")
    p.add_argument("--attn", default="auto", help="auto (flash_attention_2 on cuda when installed, else sdpa) | "
                                                  "sdpa | eager | flash_attention_2 | flex_attention")
    p.add_argument("--compile-sizes", default=None, help="sizes of the torch.compile rows (default: the last of "
                                                          "--sizes; compiling takes minutes per row on a CPU)")
    p.add_argument("--out", default=RESULTS, help="folder for <stem>.json and <stem>.md")
    p.add_argument("--stem", default=None, help="file name stem (default: the device for a full `all` run, "
                                                "else <device>-<group>[-quick])")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_ctx(args: argparse.Namespace) -> tuple[Ctx, list[str]]:
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    workload = WORKLOADS["quick" if args.quick else ("cuda" if cuda else "full")]
    if args.repeats is not None:
        workload = dataclasses.replace(workload, repeats=args.repeats)
    sizes = (args.sizes or ("tiny" if args.quick else ("1.7b" if cuda else "tiny,100m"))).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    if args.clock == "cpu" and cuda:
        raise SystemExit("--clock cpu: only with --device cpu (a GPU's time is not this process's CPU time)")
    set_clock(args.clock)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    rows = tuple(r for r in args.rows.split(",") if r)
    compile_sizes = tuple(args.compile_sizes.split(",")) if args.compile_sizes else tuple(sizes[-1:])
    return Ctx(args.device, dtype, workload, args.attn, threads, args.quick, rows, compile_sizes), sizes


def run_group(group: str, size, ctx: Ctx) -> list:
    """The group's rows; where some errored under a non-sdpa attention backend (flash / flex on a GPU), those rows
    are measured again with sdpa and say so in their note."""
    rows = GROUPS[group](size, ctx)
    impl = ctx.attn_impl()
    if impl == "sdpa" or not any(r.met == "error" for r in rows):
        return rows
    retry = {r.id: r for r in GROUPS[group](size, dataclasses.replace(ctx, attn="sdpa"))}
    for i, r in enumerate(rows):
        if r.met == "error" and r.id in retry:
            rows[i] = retry[r.id]
            rows[i].note = f"{impl} failed ({r.note[:150]}); with sdpa: {rows[i].note}"
    return rows


def main(argv: list[str] | None = None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    ctx, sizes = make_ctx(args)
    if args.group == "compile-worker":
        compiled.run_worker(ctx, sizes, args.worker_out)
        return []
    groups = list(GROUPS) if args.group == "all" else [args.group]
    meta = settings(ctx, sizes, argv)
    t0 = time.perf_counter()
    rows = []
    for group in groups:
        for name in sizes:
            t = time.perf_counter()
            got = run_group(group, SIZES[name], ctx)
            rows += got
            if got:
                eprint(f"[bench] {group} / {name}: {len(got)} rows in {time.perf_counter() - t:.0f} s")
    order = list(dict.fromkeys(r.id for r in rows))
    rank = {s: i for i, s in enumerate(sizes)}  # a group may add a size of its own (tah2-generate: 768x6) after them
    rows.sort(key=lambda r: (order.index(r.id), rank.get(r.size, len(sizes))))  # a row's sizes side by side
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    stem = args.stem or (args.device if args.group == "all" and not args.quick and not ctx.rows
                         else f"{args.device}-{args.group}" + ("-quick" if args.quick else ""))
    json_path, md_path = write(rows, meta, args.out, stem)
    print(markdown(rows, meta))
    eprint(f"[bench] {len(rows)} rows in {meta['elapsed_s']:.0f} s -> {json_path}, {md_path}")
    return rows
