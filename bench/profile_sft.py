"""Where a TaH2 SFT step goes: every op of one step of Standard and one of TaH2 (M = 2, lookahead), the `tah2-sft`
row's models and batch, process CPU time at one thread.

    python -m bench.profile_sft [--size 100m|tiny] [--tool ops|profiler] [--threads 1] [--repeats 2] [--top 25]
                                [--matmuls]

Prints, per model, after the bench row's warm-up steps: every timed step's CPU seconds (`--repeats` interleaved,
unprofiled) and the median of the per-repeat ratios; then per model the step's best seconds, the
time of the matrix multiplies (share, GFLOP from their shapes), the attention kernels and the rest, the top ops by
time and, with `--matmuls`, every matmul shape with its calls, seconds and GFLOP/s; then TaH2 ÷ Standard. `--tool ops`
(default) times each op with the process CPU clock inside a `TorchDispatchMode` and counts the minor page faults it
takes (fresh memory shows up as faults); `--tool profiler` is torch.profiler's self CPU time, which on this CPU
inflates memory-bound ops (it measured weight-gradient adds at eight times their unprofiled cost). Not a bench row: a
diagnostic.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import SIZES, WORKLOADS, Ctx, set_clock
from .train_steps import SFT_WARMUP_STEPS, run_steps, sft_models_and_step

MATMULS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")
ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class OpTimer(TorchDispatchMode):
    """Process CPU seconds, calls and minor page faults per (op, input shapes)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])  # calls, seconds, faults, flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f0, t0 = _faults(), time.process_time()
        out = func(*args, **(kwargs or {}))
        dt, df = time.process_time() - t0, _faults() - f0
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        name = func.overloadpacket.__name__
        entry = self.ops[(name, shapes[:3])]
        entry[0] += 1
        entry[1] += dt
        entry[2] += df
        if name in MATMULS and len(shapes) >= 2:
            a, b = shapes[-2], shapes[-1]
            entry[3] += 2.0 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        return out


def _ops_profile(fn) -> dict:
    timer = OpTimer()
    with timer:
        fn()
    return {k: tuple(v) for k, v in timer.ops.items()}


def _torch_profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        fn()
    ops = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    for e in prof.events():
        if e.device_type.name != "CPU" or not e.name.startswith("aten::"):
            continue
        entry = ops[(e.name[6:], tuple(tuple(s) for s in e.input_shapes[:3]))]
        entry[0] += 1
        entry[1] += e.self_cpu_time_total / 1e6
        entry[3] += e.flops or 0
    return {k: tuple(v) for k, v in ops.items()}


def by_op(ops: dict) -> dict:
    """{op: [calls, seconds, faults]} summed over the input shapes of `OpTimer.ops`-style entries."""
    out = collections.defaultdict(lambda: [0, 0.0, 0])
    for (op, _), (n, s, f, _) in ops.items():
        b = out[op]
        b[0] += n
        b[1] += s
        b[2] += f
    return out


def _summary(name: str, seconds: float, ops: dict, top: int, matmuls: bool) -> dict:
    per_op = by_op(ops)
    total = sum(v[1] for v in per_op.values())
    mm = sum(v[1] for k, v in per_op.items() if k in MATMULS)
    attn = sum(v[1] for k, v in per_op.items() if k in ATTENTION)
    flops = sum(v[3] for (op, _), v in ops.items() if op in MATMULS)
    faults = sum(v[2] for v in per_op.values())
    print(f"\n== {name}: step {seconds:.3f} CPU-s (best, unprofiled); inside ops {total:.3f} s, {faults} page faults")
    print(f"   matmuls {mm:.3f} s ({mm / total:.0%}), {flops / 1e9:.1f} GFLOP ({flops / 1e9 / max(mm, 1e-9):.0f} GFLOP/s); "
          f"attention kernels {attn:.3f} s; rest {total - mm - attn:.3f} s")
    for op, (n, s, f) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {s:7.3f} s {n:5d} calls {f:7d} faults  {op}")
    if matmuls:
        print("   matmul shapes (calls, s, GFLOP, GFLOP/s, faults):")
        for (op, shp), (n, s, f, fl) in sorted(((k, v) for k, v in ops.items() if k[0] in MATMULS),
                                               key=lambda kv: -kv[1][1]):
            print(f"   {n:4d} {s:7.3f} s {fl / 1e9:7.2f} {fl / 1e9 / max(s, 1e-9):6.1f} {f:6d}  {op} {list(shp)}")
    return {"seconds": seconds, "ops": total, "matmul": mm, "attention": attn, "flops": flops}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_sft", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m", choices=sorted(SIZES))
    p.add_argument("--tool", default="ops", choices=("ops", "profiler"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--matmuls", action="store_true", help="list every matmul shape")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_clock("cpu")
    ctx = Ctx(device="cpu", dtype=torch.float32, workload=WORKLOADS["full"], threads=args.threads)
    steps, attn = sft_models_and_step(SIZES[args.size], ctx)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} thread(s); {attn}; tool {args.tool}; "
          f"realised depth {steps['tah2']():.3f}")
    for fn in steps.values():  # the steady state the bench row times
        run_steps(fn, SFT_WARMUP_STEPS)
    seconds = {k: [] for k in steps}
    for _ in range(args.repeats):
        for k, fn in steps.items():
            t0 = time.process_time()
            fn()
            seconds[k].append(time.process_time() - t0)
    best = {k: min(v) for k, v in seconds.items()}
    for k, v in seconds.items():
        print(f"{k} steps (CPU-s): " + " ".join(f"{t:.3f}" for t in v))
    pairs = sorted(t / s for s, t in zip(seconds["standard"], seconds["tah2"], strict=True))
    print(f"TaH2 ÷ Standard per repeat: {' '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}×")
    profiler = _ops_profile if args.tool == "ops" else _torch_profile
    out = {k: _summary(k, best[k], profiler(fn), args.top, args.matmuls) for k, fn in steps.items()}
    s, t = out["standard"], out["tah2"]
    print(f"\nTaH2 ÷ Standard: step {t['seconds'] / s['seconds']:.3f}×; matmul time {t['matmul'] / s['matmul']:.3f}×; "
          f"matmul FLOPs {t['flops'] / s['flops']:.3f}×; attention {t['attention'] / s['attention']:.2f}×; other ops "
          f"{(t['ops'] - t['matmul'] - t['attention']) / (s['ops'] - s['matmul'] - s['attention']):.2f}×; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
