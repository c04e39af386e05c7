"""Compiled-decode rows: `torch.compile` decode tokens/s ÷ eager, Standard and TaH2, batch 1.

Each row runs in its own subprocess with a time limit (`python -m bench compile-worker`), so a compiler that fails,
hangs or takes too long on this machine becomes a row with the reason instead of stopping the suite. Inside it, the
eager and the compiled model (a copy whose shared decoder layers are compiled one by one, `layer.compile(dynamic=True)`:
the loop around them reads the device once per depth boundary and keeps the ragged cache's bookkeeping on the host, so
it is not one graph) are timed side by side after one warm-up (where compilation happens; its time is in the note).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .common import SIZES, Ctx, Row, Size, error_row, interleaved_best, judged, random_ids
from .tah2_decode import build_models, decode

ROWS = {"compile-standard": ("standard", "Standard decode tokens/s, torch.compile ÷ eager, batch 1"),
        "compile-tah2": ("tah2", "TaH2 decode tokens/s, torch.compile ÷ eager, batch 1")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_rows(size: Size, ctx: Ctx) -> list[Row]:
    """Runs inside the subprocess: eager vs compiled for the wanted models."""
    models, attn = build_models(size, ctx, fixed=False)
    ids = random_ids(size.vocab, 1, ctx.workload.prompt, ctx.device)
    out = []
    for row_id, (name, title) in ROWS.items():
        if not ctx.wants(row_id):
            continue
        eager = models[name]
        try:
            compiled = copy.deepcopy(eager)  # same weights; the decoder layers compiled one by one
            for layer in compiled.model.layers:
                layer.compile(dynamic=True)
            t0 = time.perf_counter()
            decode(compiled, ids, 2, ctx.device)  # compile here, outside the timed runs
            compile_s = time.perf_counter() - t0
            fns = {k: (lambda m=m: decode(m, ids, ctx.workload.new, ctx.device))
                   for k, m in (("eager", eager), ("compiled", compiled))}
            best = interleaved_best(fns, ctx.workload.repeats)
            r = best["eager"][0] / best["compiled"][0]
            out.append(Row(row_id, title, size.name, "reported", r, judged(None),
                           note=f"first compiled calls {compile_s:.0f} s; {attn}",
                           extra={"compile_seconds": compile_s, "seconds": {k: v[0] for k, v in best.items()}}))
        except Exception as exc:
            out.append(error_row(row_id, title, size.name, "reported", f"compile failed: {type(exc).__name__}: {exc}"))
        torch._dynamo.reset()
    return out


def run_one(size: Size, ctx: Ctx, row_id: str) -> Row:
    """One compiled row in its own subprocess, under the workload's time limit; a failure becomes an error row."""
    title = ROWS[row_id][1]
    limit = ctx.workload.compile_timeout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "bench", "compile-worker", "--sizes", size.name, "--device", ctx.device,
               "--dtype", str(ctx.dtype).removeprefix("torch."), "--threads", str(ctx.threads), "--attn", ctx.attn,
               "--rows", row_id, "--repeats", str(ctx.workload.repeats), "--worker-out", path]
        cmd += ["--quick"] if ctx.quick else []
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no background compile workers while timing
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return error_row(row_id, title, size.name, "reported", f"compile + timing exceeded {limit} s")
        if proc.returncode != 0 or not os.path.exists(path):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return error_row(row_id, title, size.name, "reported", f"worker exit {proc.returncode}: {tail[0]}")
        with open(path) as f:
            return Row(**json.load(f)[0])


def rows(size: Size, ctx: Ctx) -> list[Row]:
    if size.name not in ctx.compile_sizes:
        return []
    return [run_one(size, ctx, row_id) for row_id in ROWS if ctx.wants(row_id)]


def run_worker(ctx: Ctx, size_names: list[str], path: str) -> None:
    rows_ = [r.as_dict() for name in size_names for r in worker_rows(SIZES[name], ctx)]
    with open(path, "w") as f:
        json.dump(rows_, f)
