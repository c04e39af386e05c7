"""Training-memory rows: peak memory of one SFT step (forward + backward), TaH2 (M = 2) ÷ Standard.

Shape: a 2-layer Qwen3-0.6B-wide model (hidden 1024, 16 heads, 8 KV heads, head dim 128, FFN 3072) with the real
vocabulary 151,936 (tied, as Qwen3-0.6B), one micro-batch of `TOKENS` tokens (2 rows), float32 and bfloat16 autocast.
At this vocabulary the (tokens, V) logits and their gradients are the largest tensors of the step.

Each (model, precision, tokens) is measured in its own subprocess (`python -m bench.train_memory`): build the model,
run one warm-up-free step (`tah2_joint_loss` + `backward`, as `TaH2SFTTrainer` does; the Standard model is TaH2's
"standard" preset, i.e. Qwen3's forward and HF's loss), and report the process's peak resident set size
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) and the resident size just before the step. The ratio is of the peak
RSS (what the machine must hold, model and gradients included); the note also gives the step's increment over the
built model. Tokens per micro-batch: `TOKENS` (below 4096 on a CPU, see there; the note says so).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
import types

import torch

from .common import Ctx, Row, Size, error_row, judged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = Size("mem-151k", hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936, tie=True)
# Tokens per micro-batch. The issue asks for 4096; on a shared 2-core CPU one float32 step of the Standard model at
# 1024 tokens takes minutes and its peak RSS grows ~0.9 MB per token (4.09 GiB at 1024), so the CPU suite measures 1024
# (4096 is predicted at ~6.7 GiB for Standard float32: pass `python -m bench.train_memory MODEL PRECISION 4096`).
TOKENS = {"float32": 1024, "bfloat16": 1024}
PROBE_TOKENS = 256  # --quick
BATCH = 2
TIMEOUT_S = 1800


def _rss_now_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux ≥ 4.0), so the build's peak is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kb() -> int:
    """Peak RSS since the last reset (VmHWM); else `getrusage`'s lifetime peak (KiB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(model_kind: str, precision: str, tokens: int, threads: int) -> dict:
    """One SFT step of `model_kind` ("standard" | "tah2") in this process; memory in GiB."""
    from hf_loops import TAH2_PRESETS
    from hf_loops.conversion import convert_qwen3
    from hf_loops.training.tah2_trainer import tah2_joint_loss

    from .common import qwen3_source, random_ids
    from .train_steps import DECIDER_SPREAD, SUPERVISION

    torch.set_num_threads(threads)
    source = qwen3_source(SIZE)
    extra = TAH2_PRESETS["standard"] if model_kind == "standard" else {"max_iterations": 2}
    model = convert_qwen3(source, "tah2", seed=0, **extra)
    del source
    if model_kind == "tah2":
        torch.manual_seed(1)
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, DECIDER_SPREAD / SIZE.hidden ** 0.5)
    model.train().set_attn_implementation("sdpa")
    ids = random_ids(SIZE.vocab, BATCH, tokens // BATCH, "cpu")
    batch, sup = {"input_ids": ids, "labels": ids}, types.SimpleNamespace(**SUPERVISION)
    gc.collect()
    before_kb = _rss_now_kb()
    reset = _reset_peak()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        loss, out, _ = tah2_joint_loss(model, batch, sup)
    loss.backward()
    depth = float(out.iter_counts.float().mean())
    gib = 1024.0 ** 2
    return {"peak_gb": _peak_kb() / gib, "before_gb": before_kb / gib, "mean_depth": depth, "tokens": tokens,
            "peak_reset": reset, "step_s": time.perf_counter() - t0}


def _run_worker(model_kind: str, precision: str, tokens: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.train_memory", model_kind, precision, str(tokens), "--threads", str(threads)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"worker {model_kind}/{precision}/{tokens} exit {proc.returncode}: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(size: Size, ctx: Ctx) -> list[Row]:
    """One row per precision."""
    if ctx.device != "cpu" or not (ctx.quick or size.name == "100m"):
        return []  # RSS is host memory; the shape is its own, so one run per suite (at the 100m size, or --quick)
    out = []
    for precision in ("float32", "bfloat16"):
        row_id = f"tah2-mem-{'fp32' if precision == 'float32' else 'bf16'}"
        title = f"TaH2 SFT step peak memory ÷ Standard (M = 2, vocab 151,936, {precision}" + (
            " autocast)" if precision == "bfloat16" else ")")
        if not ctx.wants(row_id):
            continue
        try:
            tokens = PROBE_TOKENS if ctx.quick else TOKENS[precision]
            got = {kind: _run_worker(kind, precision, tokens, ctx.threads) for kind in ("standard", "tah2")}
            std, tah = got["standard"], got["tah2"]
            ratio = tah["peak_gb"] / std["peak_gb"]
            step = {k: v["peak_gb"] - v["before_gb"] for k, v in got.items()}
            fit = "" if tokens == 4096 else " (below the issue's 4096: one step at 4096 takes many minutes on a 2-core CPU)"
            note = (f"peak RSS {tah['peak_gb']:.2f} / {std['peak_gb']:.2f} GiB; step increment over the built model "
                    f"{step['tah2']:.2f} / {step['standard']:.2f} GiB ({step['tah2'] / max(step['standard'], 1e-9):.2f}×);"
                    f" {tokens} tokens{fit}, batch {BATCH}; d̄ {tah['mean_depth']:.2f}; 2 layers × 1024, tied head")
            out.append(Row(row_id, title, SIZE.name, "≤ 1.3×", ratio, judged(ratio <= 1.3), note=note,
                           extra={"tokens": tokens, "standard": std, "tah2": tah}))
        except Exception as exc:
            out.append(error_row(row_id, title, SIZE.name, "≤ 1.3×", exc))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.train_memory", description="one SFT step's peak memory")
    p.add_argument("model", choices=["standard", "tah2"])
    p.add_argument("precision", choices=["float32", "bfloat16"])
    p.add_argument("tokens", type=int)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.precision, args.tokens, args.threads)))


if __name__ == "__main__":
    main()
