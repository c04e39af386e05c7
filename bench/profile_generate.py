"""Where a TaH2 `generate` decode goes: process CPU time of the continuous-depth loop's parts, beside lockstep and
Standard on the same weights (the `tah2-generate` rows' models, prompts and sampling).

    python -m bench.profile_generate [--size 100m|768x6|tiny] [--batch 8] [--repeats 3] [--threads 1]

Per repeat and model: decode seconds (CPU time from the end of the prefill), realised decode depth, passes; for the
continuous-depth loop also the CPU seconds inside its layer pass (`_one_pass`, of which the LM head), decider and
mixture (`_decide_and_mix`), updater (`_advance_depth`) and token emission (`_emit_tokens`: processors, sampling,
stop criteria). Not a bench row: a diagnostic (CPU time, so other jobs on a shared CPU do not show as our time).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

import hf_loops.modeling.generation_tah2 as generation

from .common import SIZES, WORKLOADS, Ctx, random_ids, set_clock
from .tah2_decode import build_models
from .tah2_generate import ISSUE_SIZE, PROMPT, timed_generate

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


if __name__ == "__main__":
    main()
