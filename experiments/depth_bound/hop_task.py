"""Experimental (issue 31): k-hop lookup in an in-context permutation, the answer's level = hops.

    question: qf ta fq ew aw we?q2 t1 w2
    answer:   q2=q t1=a w2=e
              #### qae

The question lists `n_sym` pairs "xy" (y = π(x), π a random permutation of a random subset of the letters, in random
order), then queries "xk": follow π k times from x. The answer restates each query (copy), writes π^k(x) (level k),
and the answer line repeats the results (copy).

Why it needs depth, per pass of a 2-layer model: reading π(x) is an induction step (layer 1 writes "preceded by x"
into each y; layer 2 matches it), so one hop takes the whole 2-layer stack and k hops need k passes. A deeper pass of
TaH2 sees the earlier tokens' depth-1 keys, and those already hold "preceded by x": pass 2 can do hop 2 with pass 1's
circuit if its input says "look up y".
"""

from __future__ import annotations

import random
import string

COPY = "copy"
LETTERS = string.ascii_lowercase


def levels(max_hops: int) -> tuple[str, ...]:
    return (COPY, *(str(k) for k in range(1, max_hops + 1)))


def make_problem(rng: random.Random, n_sym: int = 8, n_queries: int = 4, max_hops: int = 2) -> dict:
    syms = rng.sample(LETTERS, n_sym)
    cyc = syms[:]  # one cycle through every symbol: π^k(x) != x for k < n_sym, so no answer is a copy of x
    rng.shuffle(cyc)
    pi = {cyc[i]: cyc[(i + 1) % n_sym] for i in range(n_sym)}
    order = syms[:]
    rng.shuffle(order)
    queries = [(rng.choice(syms), rng.randint(1, max_hops)) for _ in range(n_queries)]
    res = []
    for x, k in queries:
        for _ in range(k):
            x = pi[x]
        res.append(x)
    question = " ".join(x + pi[x] for x in order) + "?" + " ".join(f"{x}{k}" for x, k in queries)
    parts, labels = [], []
    for (x, k), r in zip(queries, res, strict=True):
        parts.append(f"{x}{k}={r}")
        labels += [COPY, COPY, COPY, str(k)]
    body = " ".join(parts)
    lab_body = []
    for i, p in enumerate(parts):
        if i:
            lab_body.append(COPY)
        lab_body += [COPY, COPY, COPY, labels[4 * i + 3]]
    tail = "".join(res)
    answer = body + "\n#### " + tail
    lab = lab_body + [COPY] * len("\n#### ") + [COPY] * len(tail)
    assert len(lab) == len(answer)
    return {"question": question, "answer": answer, "labels": lab}


def make_split(split: str, n: int, seed: int, **kw) -> list[dict]:
    """Seeded problems; splits are disjoint by construction of the generator seed stream (a problem's space is
    vast: 26!/18! letter choices × orders × queries)."""
    rng = random.Random(f"{split}:{seed}")
    return [make_problem(rng, **kw) for _ in range(n)]
