"""Training-step and prefill ratios of the looped models to their plain baselines (issue "Speed and memory" rows).

    python bench/bench_train_steps.py [--hidden 256 --layers 6 --seq 512 --batch 4 --repeats 5]

Rows, each measured side by side in one run (same weights, interleaved repeats, best of N, fp32 on this device):
- TaH2 SFT step (M = 2, lookahead supervision through `tah2_joint_loss`, forward + backward) ÷ Standard SFT step;
- SGT (3 looped layers, 2 heads, K = 1) train step ÷ vanilla (empty plan) train step;
- Block Loop (3 blocks, depth 1) train step ÷ vanilla;
- SpiralFormer-B prefill (chunk sizes 8/4/2/1) ÷ LoopedFormer prefill ({1,1} over the same layers), sequence --spiral-seq.
Writes `bench/results/train_steps.json` and `.md`. Not a timed test: ratios travel between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_loops import TAH2_PRESETS, SGTConfig, SpiralFormerConfig
from hf_loops.conversion import convert_qwen3
from hf_loops.modeling.modeling_sgt import SGTForCausalLM
from hf_loops.modeling.modeling_spiralformer import SpiralFormerForCausalLM
from hf_loops.training.tah2_trainer import tah2_joint_loss

SUPERVISION = dict(coverage=0.99, decider_loss_weight=0.05, cost_min=1e-6, cost_max=1.0, beta_clamp=(0.02, 50.0),
                   bce_margin=0.0, lookahead=True)


def best_time(fns: dict, repeats: int) -> dict:
    """Best wall time of each callable, the callables interleaved repeat by repeat (one warm-up call each)."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def qwen_config(args, **kw) -> Qwen3Config:
    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=max(1, args.hidden // 128), head_dim=64, max_position_embeddings=8192,
                       **kw)


def tah2_rows(args, ids) -> dict:
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(qwen_config(args))
    standard = convert_qwen3(qwen, "tah2", seed=0, **TAH2_PRESETS["standard"]).train()
    tah2 = convert_qwen3(qwen, "tah2", seed=0, max_iterations=2).train()
    with torch.no_grad():  # a decider that sends about `--continue-rate` of the tokens to depth 2
        tah2.decider.score.weight.normal_(0.0, 0.5)
    sup = types.SimpleNamespace(**SUPERVISION)
    batch = {"input_ids": ids, "labels": ids}
    depth = {}

    def step(model, key):
        def run():
            model.zero_grad(set_to_none=True)
            loss, out, _ = tah2_joint_loss(model, batch, sup)
            loss.backward()
            depth[key] = float(out.iter_counts.float().mean())
        return run

    t = best_time({"standard": step(standard, "standard"), "tah2": step(tah2, "tah2")}, args.repeats)
    return {"tah2_sft_step_over_standard": t["tah2"] / t["standard"], "tah2_mean_depth": depth["tah2"],
            "seconds": t}


def sgt_rows(args, ids) -> dict:
    torch.manual_seed(0)
    base = qwen_config(args).to_dict()
    heads = args.hidden // 64
    top = list(range(args.layers - 3, args.layers))
    plan = [{"layer": layer, "heads": [0, heads - 1], "depth": 1} for layer in top]
    models = {
        "vanilla": SGTForCausalLM(SGTConfig(**base)),
        "sgt": SGTForCausalLM(SGTConfig(**base, loop_plan=plan)),
        "block": SGTForCausalLM(SGTConfig(**base, loop_mode="block", block_loop_layers=top, block_loop_depth=1)),
    }
    state = models["vanilla"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
        m.train()

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()
        return run

    t = best_time({k: step(m) for k, m in models.items()}, args.repeats)
    return {"sgt_train_step_over_vanilla": t["sgt"] / t["vanilla"],
            "block_loop_train_step_over_vanilla": t["block"] / t["vanilla"], "seconds": t}


def spiral_rows(args) -> dict:
    torch.manual_seed(0)
    n = args.layers
    counts = dict(num_pre_layers=n // 4, num_loop_layers=n - 2 * (n // 4), num_post_layers=n // 4)
    base = {k: v for k, v in qwen_config(args).to_dict().items() if k != "num_hidden_layers"}
    spiral = SpiralFormerForCausalLM(SpiralFormerConfig(**base, **counts, chunk_sizes=[8, 4, 2, 1])).eval()
    looped = SpiralFormerForCausalLM(SpiralFormerConfig(**base, **counts, chunk_sizes=[1, 1])).eval()
    ids = torch.randint(3, args.vocab, (1, args.spiral_seq), generator=torch.Generator().manual_seed(1))

    def prefill(model):
        def run():
            with torch.no_grad():
                model(ids, use_cache=False, logits_to_keep=1)
        return run

    t = best_time({"spiral_b": prefill(spiral), "looped": prefill(looped)}, args.repeats)
    return {"spiralformer_b_prefill_over_looped": t["spiral_b"] / t["looped"], "seconds": t}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--spiral-seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    result = {"settings": vars(args), "device": "cpu", "dtype": "float32"}
    result.update(tah2_rows(args, ids))
    result.update(sgt_rows(args, ids))
    result.update(spiral_rows(args))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_steps.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = [("TaH2 SFT step ÷ Standard (M = 2, lookahead)", "≤ 1.9×", result["tah2_sft_step_over_standard"],
             f"mean depth {result['tah2_mean_depth']:.2f}"),
            ("SGT train step ÷ vanilla (3 layers, 2 heads, K = 1)", "≤ 1.05×", result["sgt_train_step_over_vanilla"], ""),
            ("Block Loop train step ÷ vanilla (3 blocks)", "reported", result["block_loop_train_step_over_vanilla"], ""),
            ("SpiralFormer-B prefill ÷ LoopedFormer", "≤ 0.95×", result["spiralformer_b_prefill_over_looped"],
             f"L = {args.spiral_seq}")]
    md = ["| row | goal | measured | note |", "|---|---|---|---|"]
    md += [f"| {name} | {goal} | {value:.3f}× | {note} |" for name, goal, value, note in rows]
    text = "\n".join(md) + "\n"
    with open(os.path.join(args.out, "train_steps.md"), "w") as f:
        f.write(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
