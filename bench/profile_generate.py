"""Where a TaH2 `generate` decode goes: process CPU time of the continuous-depth loop's parts, beside lockstep and
Standard on the same weights (the `tah2-generate` rows' models, prompts and sampling).

    python -m bench.profile_generate [--size 100m|768x6|tiny] [--batch 8] [--repeats 3] [--threads 1] [--ops]

Per repeat and model: decode seconds (CPU time from the end of the prefill), realised decode depth, passes; for the
continuous-depth loop also the CPU seconds inside its layer pass (`_one_pass`, of which the LM head), decider and
mixture (`_decide_and_mix`), updater (`_advance_depth`) and token emission (`_emit_tokens`: processors, sampling,
stop criteria). With `--ops`, one more decode of Standard and of the continuous-depth loop with every op timed
(`bench.profile_sft`'s `OpTimer`): the matmuls' seconds, calls and GFLOP, each model's other top ops, and what the
matmuls alone allow the FLOPs-bound efficiency to reach (TaH2's matmul GFLOP/s ÷ Standard's in the decode, the
prefill's ops left out). Not a bench row: a diagnostic (CPU time, so other jobs on a shared CPU do not show as our time).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

import hf_loops.modeling.generation_tah2 as generation

from .common import SIZES, WORKLOADS, Ctx, random_ids, set_clock
from .profile_sft import MATMULS, OpTimer, by_op
from .tah2_decode import build_models
from .tah2_generate import ISSUE_SIZE, PROMPT, flops_ratio, timed_generate

PARTS = ("_one_pass", "_decide_and_mix", "_advance_depth", "_emit_tokens")


def _timing(seconds: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.process_time() - t0
    return wrapped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_generate", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m", choices=sorted({*SIZES, ISSUE_SIZE.name}))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ops", action="store_true", help="also time every op of one decode per model")
    p.add_argument("--top", type=int, default=12, help="with --ops: the other ops listed per model")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_clock("cpu")
    size = SIZES.get(args.size, ISSUE_SIZE)
    ctx = Ctx(device="cpu", dtype=torch.float32, workload=WORKLOADS["full"], threads=args.threads)
    models, _ = build_models(size, ctx, fixed=False)
    ids = random_ids(size.vocab, args.batch, PROMPT, "cpu", seed=args.batch)
    seconds: dict[str, float] = collections.defaultdict(float)
    originals = {name: getattr(generation, name) for name in PARTS}
    head = models["tah2"].lm_head
    head_forward = head.forward
    runs = {"standard": ("standard", {}), "continuous": ("tah2", {"continuous_depth": True}),
            "lockstep": ("tah2", {"continuous_depth": False})}
    try:
        for name in PARTS:
            setattr(generation, name, _timing(seconds, name, originals[name]))
        head.forward = _timing(seconds, "lm_head", head_forward)
        for key, kw in runs.values():  # warm-up
            timed_generate(models[key], ids[:, :8], 3, "cpu", seed=5, **kw)
        for _ in range(args.repeats):
            for name, (key, kw) in runs.items():
                seconds.clear()
                secs, info = timed_generate(models[key], ids, args.new, "cpu", seed=5, **kw)
                flat = [d for row in info["depths"] for d in row]
                parts = ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()) if name == "continuous" else ""
                print(f"{name:10s} {secs:7.2f} s  depth {sum(flat) / len(flat):.3f}  passes {info['steps']}  {parts}",
                      flush=True)
    finally:
        for name, fn in originals.items():
            setattr(generation, name, fn)
        del head.forward
    if args.ops:
        _op_profile(models, ids, args.new, runs, args.top)


def _op_profile(models, ids, new: int, runs: dict, top: int) -> None:
    """One `generate` each of Standard and the continuous-depth loop under `OpTimer`: matmul seconds / calls / GFLOP
    and the other top ops; then TaH2's matmul GFLOP/s ÷ Standard's, the efficiency the matmuls alone allow."""
    mm: dict[str, tuple[float, int, float]] = {}
    info_of = {}
    for name in ("standard", "continuous"):
        key, kw = runs[name]
        timer, model = OpTimer(), models[key]
        at_prefill = {}
        prefill = model._prefill

        # the decode's ops = all ops − those counted when the prefill returns
        def counted_prefill(*args, prefill=prefill, timer=timer, at_prefill=at_prefill, **kwargs):
            out = prefill(*args, **kwargs)
            at_prefill.update({k: list(v) for k, v in timer.ops.items()})
            return out

        model._prefill = counted_prefill  # timed_generate wraps this and removes the attribute when it returns
        with timer:
            secs, info = timed_generate(model, ids, new, "cpu", seed=5, **kw)
        ops = {k: [a - b for a, b in zip(v, at_prefill.get(k, [0, 0.0, 0, 0.0]), strict=True)]
               for k, v in timer.ops.items()}
        per_op = by_op(ops)
        matmuls = [v for (op, _), v in ops.items() if op in MATMULS]
        mm[name] = (sum(v[1] for v in matmuls), sum(v[0] for v in matmuls), sum(v[3] for v in matmuls) / 1e9)
        info_of[name] = info
        rest = sorted(((op, v) for op, v in per_op.items() if op not in MATMULS), key=lambda kv: -kv[1][1])[:top]
        inside = sum(v[1] for v in per_op.values())
        print(f"\n== {name} (ops timed, decode only): decode {secs:.2f} s, inside ops {inside:.2f} s; "
              f"matmuls {mm[name][0]:.3f} s, {mm[name][1]} calls, {mm[name][2]:.1f} GFLOP")
        for op, (n, s, _) in rest:
            print(f"   {s:7.3f} s {n:6d} calls  {op}")
    (ms, _, gs), (mt, _, gt) = mm["standard"], mm["continuous"]
    flops = flops_ratio(models["tah2"].config, info_of["continuous"], ids.shape[1], new)
    print(f"\nmatmul seconds TaH2 ÷ Standard {mt / ms:.3f}× for {gt / gs:.3f}× the matmul GFLOP (decode only): "
          f"TaH2's matmuls run at {gt / mt / (gs / ms):.3f} of Standard's GFLOP/s, the FLOPs-bound efficiency the "
          f"matmuls alone allow (decode FLOPs ratio {flops:.3f})")


if __name__ == "__main__":
    main()
