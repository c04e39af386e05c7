"""Experimental (issue 31): from-scratch arms on the k-hop task (`hop_task`), the evidence that depth limits it.

    PYTHONPATH=. python experiments/depth_bound/hop_pretrain.py --layers 2 [--looped 2 --tah2-preset tah2-fixed]
"""

from __future__ import annotations

import argparse
import os
import time

import common as C
import hop2_task as H2
import hop_task as H1
import torch


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--looped", type=int, default=1)
    p.add_argument("--tah2-preset", default=None, choices=["tah2-fixed", "ouro"])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--n-sym", type=int, default=8)
    p.add_argument("--n-queries", type=int, default=4)
    p.add_argument("--max-hops", type=int, default=2)
    p.add_argument("--n-train", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", default="at_x", choices=["pkg", "at_x", "eq"],
                   help="pkg: hf_loops.data.hop_task (hash-disjoint splits); at_x: hop2_task; eq: hop_task")
    p.add_argument("--tag", default="")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    kw = dict(n_sym=a.n_sym, n_queries=a.n_queries, max_hops=a.max_hops)
    tok = C.tokenizer()
    enc = C.CharEncoder(tok)
    if a.format == "pkg":
        from hf_loops.data import hop_task as HP

        spec = HP.HopTaskSpec(**kw)
        lv = spec.levels
        tr_rows, va_rows = HP.make_split("train", a.n_train, 0, spec), HP.make_split("validation", 1000, 0, spec)
    else:
        H = H2 if a.format == "at_x" else H1
        lv = H.levels(a.max_hops)
        tr_rows, va_rows = H.make_split("train", a.n_train, 0, **kw), H.make_split("validation", 1000, 0, **kw)
    enc.check(tr_rows[:20])
    tr, va = C.tensors_levels(enc, tr_rows, lv), C.tensors_levels(enc, va_rows, lv)
    if a.tah2_preset:
        model = C.tah2_from_scratch(a.tah2_preset, a.layers, a.looped, hidden=a.hidden, heads=a.heads, ffn=a.ffn,
                                    seed=a.seed)
    else:
        model = C.qwen3(a.layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, looped=a.looped, seed=a.seed)
    name = a.tag + f"hop-L{a.layers}" + (f"x{a.looped}" if a.looped > 1 else "") + (f"-{a.tah2_preset}" if a.tah2_preset else "")
    print(f"[{name}] {sum(q.numel() for q in model.parameters())} parameters, {tr['ids'].shape} train", flush=True)
    t0 = time.perf_counter()
    res = C.train(model, tr, va, a.steps, lr=a.lr, batch=a.batch, eval_every=a.eval_every, seed=a.seed,
                  log=lambda s: print(f"[{name}] {s}", flush=True))
    C.dump(os.path.join(C.OUT, "hop", name + f"-s{a.seed}.json"),
           {"settings": vars(a), "curve": res["curve"], "wall": time.perf_counter() - t0})
    if a.save and not a.looped > 1:
        model.config.use_cache = True
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.bos_token_id = None
        model.save_pretrained(a.save)
        tok.save_pretrained(a.save)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
