"""Experimental (issue 31): k-hop lookup, the answer predicted at the query letter (a classic induction step).

    question: qf ta fq ew aw we hb bh:2q. 1t. 2w.
    answer:   #### 2qe 1ta 2we

The question lists `n_sym` pairs "xy" (y = π(x), π one random cycle through `n_sym` random letters, pairs in random
order), then `n_queries` queries "kx." over distinct letters x. The answer restates each query with its result in
place of the dot: π^k(x) (level k); every other character is copied at a fixed offset (level "copy").

Why 2 layers do 1 hop and not 2: at the answer's x, layer 1 brings k (the previous token), and at each pair's y it
writes "preceded by x"; layer 2 matches x against that and reads y = π(x). A second hop needs a second lookup on the
first one's result: a third layer. A deeper TaH2 pass sees the pair tokens' depth-1 keys, which already hold
"preceded by x", so pass 2 can do hop 2 with pass 1's circuit.
"""

from __future__ import annotations

import random
import string

COPY = "copy"
LETTERS = string.ascii_lowercase


def levels(max_hops: int) -> tuple[str, ...]:
    return (COPY, *(str(k) for k in range(1, max_hops + 1)))


def make_problem(rng: random.Random, n_sym: int = 8, n_queries: int = 4, max_hops: int = 2,
                 hop_weights=None) -> dict:
    syms = rng.sample(LETTERS, n_sym)
    cyc = syms[:]
    rng.shuffle(cyc)
    pi = {cyc[i]: cyc[(i + 1) % n_sym] for i in range(n_sym)}
    order = syms[:]
    rng.shuffle(order)
    xs = rng.sample(syms, n_queries)
    ks = rng.choices(range(1, max_hops + 1), weights=hop_weights, k=n_queries)
    res = []
    for x, k in zip(xs, ks, strict=True):
        for _ in range(k):
            x = pi[x]
        res.append(x)
    question = " ".join(x + pi[x] for x in order) + ":" + " ".join(f"{k}{x}." for x, k in zip(xs, ks, strict=True))
    answer = "#### " + " ".join(f"{k}{x}{r}" for x, k, r in zip(xs, ks, res, strict=True))
    labels = [COPY] * 5
    for i, k in enumerate(ks):
        if i:
            labels.append(COPY)
        labels += [COPY, COPY, str(k)]
    assert len(labels) == len(answer)
    return {"question": question, "answer": answer, "labels": labels}


def make_split(split: str, n: int, seed: int, **kw) -> list[dict]:
    rng = random.Random(f"hop2:{split}:{seed}")
    return [make_problem(rng, **kw) for _ in range(n)]
