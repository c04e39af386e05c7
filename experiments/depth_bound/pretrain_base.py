"""Pretrain (from scratch, seeded) the tiny Qwen3 base that knows the depth-bound task at its depth.

    PYTHONPATH=. python experiments/depth_bound/pretrain_base.py [--layers 1] [--steps 4000] [--out DIR]

Trains `common.qwen3(layers)` on MSB-first addition (`hf_loops.data.depth_task`, the train split) with the
answer-only loss until the validation curve is flat, saves it as a plain Qwen3ForCausalLM checkpoint with the
64-token character tokenizer and the embedded base's chat template (`hf-loops train --base DIR` reads it), and writes
`pretrain_report.json` beside it: settings, steps, tokens, the validation curve (exact match, loss, accuracy per
difficulty level), the final per-level accuracy.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import common as C
import torch

from hf_loops.data import depth_task as D


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--looped", type=int, default=1, help="apply the layer stack this many times (evidence only)")
    p.add_argument("--tah2-preset", default=None, choices=["tah2-fixed", "ouro"],
                   help="evidence only: a from-scratch TaH2 with this fixed-depth preset, M = --looped")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--digits", type=int, default=4)
    p.add_argument("--nine-prob", type=float, default=0.3)
    p.add_argument("--n-train", type=int, default=100_000)
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(C.OUT, "base"))
    p.add_argument("--no-save", action="store_true", help="report only (the evidence runs)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = D.DepthTaskSpec(digits=a.digits, nine_prob=a.nine_prob)
    t0 = time.perf_counter()
    tok, tr, va = C.load_data(a.n_train, a.n_val, spec, seed=0)  # data seed fixed: the model seed varies alone
    if a.tah2_preset:
        model = C.tah2_from_scratch(a.tah2_preset, a.layers, a.looped, hidden=a.hidden, heads=a.heads, ffn=a.ffn,
                                    seed=a.seed)
    else:
        model = C.qwen3(a.layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, looped=a.looped, seed=a.seed)
    name = f"L{a.layers}" + (f"x{a.looped}" if a.looped > 1 else "") + (f"-{a.tah2_preset}" if a.tah2_preset else "")
    print(f"[{name}] {sum(p.numel() for p in model.parameters())} parameters, {tr['ids'].shape[0]} train problems "
          f"of {tr['ids'].shape[1]} tokens", flush=True)
    res = C.train(model, tr, va, a.steps, lr=a.lr, batch=a.batch, warmup=a.warmup, eval_every=a.eval_every,
                  seed=a.seed, log=lambda s: print(f"[{name}] {s}", flush=True))
    report = {"command": "python experiments/depth_bound/pretrain_base.py " + " ".join(argv or []),
              "arm": name, "settings": vars(a), "spec": {"digits": spec.digits, "nine_prob": spec.nine_prob},
              "n_params": sum(p.numel() for p in model.parameters()), "steps": res["steps"],
              "train_tokens": res["train_tokens"], "train_seconds": res["seconds"],
              "wall_seconds": time.perf_counter() - t0, "curve": res["curve"], "final": res["curve"][-1],
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    out = a.out if not a.no_save else os.path.join(C.OUT, "evidence", name)
    os.makedirs(out, exist_ok=True)
    if not a.no_save:
        if a.looped > 1:
            raise SystemExit("a looped model is not a plain Qwen3 checkpoint: use --no-save")
        model.config.use_cache = True
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.bos_token_id = None
        model.save_pretrained(out)
        tok.save_pretrained(out)
    C.dump(os.path.join(out, "pretrain_report.json"), report)
    print(f"[{name}] wrote {out}", flush=True)


if __name__ == "__main__":
    main()
