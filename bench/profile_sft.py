"""Where a TaH2 SFT step goes: torch.profiler over one step of Standard and one of TaH2 (M = 2, lookahead), the
`tah2-sft` row's models and batch, process CPU time.

    python -m bench.profile_sft [--size 100m|tiny] [--threads 1] [--top 25] [--matmuls]

Prints, per model: the step's CPU seconds (best of `--repeats`, outside the profiler), the profiled self time of the
matrix multiplies (their share, their FLOPs as the profiler counts them), and the top ops by self time; `--matmuls`
also lists every matmul shape with its call count, gradient mode and time. Not a bench row: a diagnostic.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .common import SIZES, WORKLOADS, Ctx, set_clock
from .train_steps import sft_models_and_step

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _profile(fn):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        fn()
    return prof


def _summary(name: str, seconds: float, prof, top: int, matmuls: bool) -> dict:
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    by_op = collections.Counter()
    for e in events:
        by_op[e.name] += e.self_cpu_time_total / 1e6
    mm = sum(v for k, v in by_op.items() if k in MATMULS)
    attn = sum(v for k, v in by_op.items() if k in ATTENTION)
    flops = sum(e.flops or 0 for e in events if e.name in MATMULS)
    print(f"\n== {name}: step {seconds:.3f} CPU-s (best, unprofiled); profiled self time {total:.3f} s")
    print(f"   matmuls {mm:.3f} s ({mm / total:.0%}), {flops / 1e9:.1f} GFLOP; sdpa kernels {attn:.3f} s; "
          f"rest {total - mm - attn:.3f} s")
    for k, v in by_op.most_common(top):
        print(f"   {v:7.3f} s  {k}")
    if matmuls:
        shapes = collections.defaultdict(lambda: [0, 0.0, 0])
        for e in events:
            if e.name in MATMULS:
                key = (e.name, str(e.input_shapes[:3]))
                s = shapes[key]
                s[0] += 1
                s[1] += e.self_cpu_time_total / 1e6
                s[2] += e.flops or 0
        print("   matmul shapes (calls, s, GFLOP, GFLOP/s):")
        for (op, shp), (n, s, f) in sorted(shapes.items(), key=lambda kv: -kv[1][1]):
            print(f"   {n:4d} {s:7.3f} s {f / 1e9:7.2f} {f / 1e9 / max(s, 1e-9):6.1f}  {op} {shp}")
    return {"seconds": seconds, "profiled": total, "matmul": mm, "attention": attn, "flops": flops,
            "ops": dict(by_op.most_common(top))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_sft", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m", choices=sorted(SIZES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--matmuls", action="store_true", help="list every matmul shape")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_clock("cpu")
    ctx = Ctx(device="cpu", dtype=torch.float32, workload=WORKLOADS["full"], threads=args.threads)
    steps, attn = sft_models_and_step(SIZES[args.size], ctx)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} thread(s); {attn}; "
          f"realised depth {steps['tah2']():.3f}")
    best = {}
    for _ in range(args.repeats):
        for k, fn in steps.items():
            t0 = time.process_time()
            fn()
            best[k] = min(best.get(k, float("inf")), time.process_time() - t0)
    out = {k: _summary(k, best[k], _profile(fn), args.top, args.matmuls) for k, fn in steps.items()}
    s, t = out["standard"], out["tah2"]
    print(f"\nTaH2 ÷ Standard: step {t['seconds'] / s['seconds']:.3f}×; matmul time {t['matmul'] / s['matmul']:.3f}×; "
          f"matmul FLOPs {t['flops'] / s['flops']:.3f}×; non-matmul time "
          f"{(t['profiled'] - t['matmul']) / (s['profiled'] - s['matmul']):.3f}×; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
