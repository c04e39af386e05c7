"""Experimental (issue 35): can depth pay for SGT's baselines on the depth-bound hop task? Vanilla (the embedded
2-layer hop base as an SGT with no loops) vs Block Loop (layer L run twice), post-trained the same way (completion-only
loss, AdamW, the demo's 120 steps x 64 problems, lr 2e-3, cosine, 10 warm-up steps), scored by greedy exact match on
held-out problems of the validation split (data seed 0) and per-level accuracy of the result letters.

    PYTHONPATH=. python experiments/depth_bound/sgt_hop.py [--seeds 0 1 2] [--layers 1] [--steps 120] [--n 200]
"""

import argparse
import math
import time

import torch


def encode(tok, rows):
    """(ids, labels) of every problem: the chat-formatted prompt and answer, loss on the answer only."""
    out = []
    for r in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                         add_generation_prompt=True)
        full = tok.apply_chat_template([{"role": "user", "content": r["question"]},
                                        {"role": "assistant", "content": r["answer"]}], tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        out.append((ids, [-100] * len(p) + ids[len(p):]))
    return out


def build(base, arch, layers):
    from hf_loops.conversion import convert_qwen3

    if arch == "vanilla":
        return convert_qwen3(base, "sgt", loop_plan=[], seed=0)
    return convert_qwen3(base, "sgt", loop_mode="block", block_loop_layers=layers, block_loop_depth=1, loop_plan=[],
                         seed=0)


def train(model, data, steps, batch, lr, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=g).tolist()
    model.train()
    for step in range(steps):
        chunk = [data[i % len(data)] for i in order[step * batch:(step + 1) * batch]]
        n = max(len(x) for x, _ in chunk)
        ids = torch.tensor([x + [0] * (n - len(x)) for x, _ in chunk])
        lab = torch.tensor([y + [-100] * (n - len(y)) for _, y in chunk])
        mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in chunk])
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return loss.item()


@torch.no_grad()
def score(model, tok, rows):
    """Exact match (greedy, teacher-forced argmax of every answer token: the answer is fixed-length) and the per-level
    accuracy of the result letters."""
    data = encode(tok, rows)
    em, hits, tot = 0, {}, {}
    for (ids, lab), r in zip(data, rows):
        x = torch.tensor([ids])
        pred = model(input_ids=x).logits[0, :-1].argmax(-1)
        tgt = torch.tensor(lab[1:])
        m = tgt != -100
        ok = (pred[m] == tgt[m])
        em += bool(ok.all())
        ans_tokens = ok.tolist()
        for i, level in enumerate(r["labels"]):
            if level in ("1", "2"):
                tot[level] = tot.get(level, 0) + 1
                hits[level] = hits.get(level, 0) + ans_tokens[i]
    return em / len(rows), {k: hits[k] / tot[k] for k in sorted(tot)}


def main():
    from transformers import AutoTokenizer

    from hf_loops.data import hop_base_dir, hop_task
    from hf_loops.demo.settings import HOP_SPEC

    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--archs", nargs="+", default=["vanilla", "block"])
    a = p.parse_args()
    torch.set_num_threads(1)
    base = hop_base_dir()
    tok = AutoTokenizer.from_pretrained(base)
    train_rows = hop_task.make_split("train", a.steps * 64, 1, HOP_SPEC)
    val = hop_task.make_split("validation", a.n, 0, HOP_SPEC)
    data = encode(tok, train_rows)
    for seed in a.seeds:
        for arch in a.archs:
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            model = build(base, arch, a.layers)
            loss = train(model, data, a.steps, 64, a.lr, seed)
            em, lv = score(model, tok, val)
            print(f"seed {seed} {arch:8s} layers {a.layers}: exact match {100 * em:.1f} %, result letters by level "
                  f"{ {k: round(100 * v, 1) for k, v in lv.items()} }, final loss {loss:.3f}, {time.perf_counter() - t0:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
