"""TaH2 decode benchmark, reported as ratios to the Standard (M = 1) model with the same weights.

    python bench/bench_tah2.py [--hidden 256 --layers 4 --vocab 8192 --prompt 128 --new 64 --batch 4]

Measures, for Standard, TaH2 (adaptive, learned decider) and TaH2-fixed (every token runs M depths):
greedy-decode tokens/s, KV-cache bytes after decoding, realised mean depth, and the decode FLOPs of the spec's
accounting for the realised depth pattern. Writes `bench/results/tah2.json` and `bench/results/tah2.md`.
Not a timed test: the best of `--repeats` interleaved runs per model, reported as ratios so they travel between
machines.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_loops import TAH2_PRESETS
from hf_loops.analysis.flops_tah2 import decode_flops_fixed, decode_flops_standard, decode_flops_tah2
from hf_loops.conversion import convert_qwen3


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t) and t.dim() == 4 and t.shape[1] > 1:  # K/V slots (metadata slots have 1 "head")
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def decode(model, ids, new_tokens, **kw):
    out = model(ids, use_cache=True, logits_to_keep=1, **kw)
    cache, depths = out.cache, []
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(nxt, cache=cache, use_cache=True, **kw)
        cache = out.cache
        depths.append(out.iter_counts[:, -1])
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": ids.shape[0] * new_tokens / elapsed, "cache_bytes": cache_bytes(cache),
            "depths": torch.stack(depths, 1), "prompt_depths": cache.token_depth[:, : ids.shape[1]]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-iterations", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is the least noisy on a shared CPU)")
    p.add_argument("--decider-spread", type=float, default=1.0,
                   help="std of the random decider score weights (an untrained decider sits at g = 0.5)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 2)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                        num_hidden_layers=args.layers, num_attention_heads=heads,
                                        num_key_value_heads=max(heads // 2, 1), head_dim=64)).eval()
    M = args.max_iterations
    models = {
        "standard": convert_qwen3(qwen, "tah2", **TAH2_PRESETS["standard"]).eval(),
        "tah2": convert_qwen3(qwen, "tah2", max_iterations=M).eval(),
        "tah2-fixed": convert_qwen3(qwen, "tah2", max_iterations=M, **TAH2_PRESETS["tah2-fixed"]).eval(),
    }
    with torch.no_grad():
        models["tah2"].decider.score.weight.normal_(0.0, args.decider_spread)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt))
    for m in models.values():  # warm-up
        decode(m, ids[:, :16], 4)
    # Interleave repeats so machine noise hits every model alike; keep each model's fastest run.
    results = {}
    for _ in range(args.repeats):
        for name, m in models.items():
            r = decode(m, ids, args.new)
            if name not in results or r["tokens_per_s"] > results[name]["tokens_per_s"]:
                results[name] = r

    cfg = models["tah2"].config
    std = results["standard"]
    rows = {}
    for name, r in results.items():
        depths = r["depths"]
        if name == "standard":
            flops = decode_flops_standard(cfg, args.prompt, args.new)
        elif name == "tah2-fixed":
            flops = decode_flops_fixed(cfg, args.prompt, args.new, M)
        else:
            flops = sum(decode_flops_tah2(cfg, depths[b].tolist(), r["prompt_depths"][b].tolist(), M)
                        for b in range(args.batch)) / args.batch
        rows[name] = {
            "mean_decode_depth": float(depths.float().mean()),
            "tokens_per_s_ratio": r["tokens_per_s"] / std["tokens_per_s"],
            "kv_bytes_ratio": r["cache_bytes"] / std["cache_bytes"],
            "decode_flops_ratio": flops / decode_flops_standard(cfg, args.prompt, args.new),
        }
    os.makedirs(args.out, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    with open(os.path.join(args.out, "tah2.json"), "w") as f:
        json.dump({"settings": meta, "device": "cpu", "results": rows}, f, indent=2)
    lines = ["| model | mean decode depth | tokens/s ÷ Standard | KV bytes ÷ Standard | decode FLOPs ÷ Standard |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['mean_decode_depth']:.2f} | {r['tokens_per_s_ratio']:.2f} | "
                     f"{r['kv_bytes_ratio']:.2f} | {r['decode_flops_ratio']:.2f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "tah2.md"), "w") as f:
        f.write(f"TaH2 decode ratios ({meta})\n\n{table}\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
