"""The run's settings, and its rows as JSON and as a markdown table."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict

import torch
import transformers

from .common import SIZES, Ctx, Row, clock_name, num_params


def settings(ctx: Ctx, sizes: list[str], argv: list[str]) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    if ctx.device.startswith("cuda") and torch.cuda.is_available():
        cpu = f"{cpu}; GPU {torch.cuda.get_device_name()}"
    return {
        "command": "python -m bench " + " ".join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": ctx.device, "dtype": str(ctx.dtype).removeprefix("torch."), "threads": ctx.threads,
        "attn_requested": ctx.attn, "quick": ctx.quick, "rows_filter": list(ctx.rows),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "machine": cpu, "cpu_count": os.cpu_count(),
        "workload": asdict(ctx.workload),
        "sizes": {name: {**asdict(SIZES[name]), "params": num_params(SIZES[name])} for name in sizes},
        "method": "ratios side by side in one run: same weights, one warm-up, interleaved repeats, best of N",
        "clock": clock_name(), "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }


def fmt(row: Row) -> str:
    if row.measured is None:
        return "—"
    return f"{row.measured:.3f}{row.unit}"


def markdown(rows: list[Row], meta: dict) -> str:
    sizes = ", ".join(f"{k} ({v['params'] / 1e6:.0f}M params)" for k, v in meta["sizes"].items())
    w = meta["workload"]
    head = (f"{meta['device']}, {meta['dtype']}, {meta['threads']} threads, torch {meta['torch']}, transformers "
            f"{meta['transformers']}; sizes {sizes}; decode prompt {w['prompt']} + {w['new']} new tokens, training "
            f"batch {w['train_batch']} × {w['train_seq']}, SpiralFormer L = {w['spiral_seq']}; best of "
            f"{w['repeats']} interleaved repeats after one warm-up (the TaH2 SFT rows: the steps their note says)"
            + (" (--quick)" if meta["quick"] else "")
            + f"; clock {meta.get('clock', 'wall')}; load average {meta.get('load_avg_start', ['?'])[0]} at the start"
            + (f", {meta['load_avg_end'][0]} at the end" if "load_avg_end" in meta else ""))
    lines = [head, "", "| row | size | goal | measured | met? | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(f"| {r.name} | {r.size} | {r.goal} | {fmt(r)} | {r.met} | {note} |")
    return "\n".join(lines) + "\n"


def write(rows: list[Row], meta: dict, out_dir: str, stem: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    with open(json_path, "w") as f:
        json.dump({"settings": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(markdown(rows, meta))
    return json_path, md_path


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)
