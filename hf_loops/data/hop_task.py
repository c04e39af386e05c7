"""A seeded depth-bound task: k-hop lookup in an in-context permutation, each result labelled by its hop count.

One problem (`n_sym = 8`, `n_queries = 4`, `max_hops = 2`):

    question: qf ta fq ew aw we hb bh:2q. 1t. 2w. 1h.
    answer:   #### 2qe 1ta 2we 1hb

The question lists `n_sym` letter pairs "xy" (y = π(x), π one random cycle through `n_sym` distinct random letters,
the pairs in random order), a colon, then `n_queries` queries "kx." over distinct letters x with k in
1..`max_hops`. The answer line restates every query with π^k(x) in place of the dot. The result letter's difficulty
level is its hop count k ("1", "2", ...); every other answer character ("#### ", the restated k and x, the spaces) is
"copy": it sits at a fixed offset from the same character of the question.

Why it is depth-bound: the result is predicted at the restated x, so one hop is one induction step. Layer 1 writes
"preceded by x" into each pair's y (a previous-token head) and brings k to the restated x; layer 2 matches x against
it and reads y = π(x). A second hop is a second lookup keyed by the first one's result, so it needs the whole circuit
again on top: a 2-layer model reads 1-hop results and guesses 2-hop ones, whatever it is trained on (measured in
`experiments/depth_bound/README.md`). A deeper TaH2 pass sees the pair tokens' depth-1 keys, which already hold
"preceded by x", so pass 2 can run hop 2 with pass 1's circuit.

Splits: a problem belongs to one split by a stable hash of its question (`depth_task.hash_split`), so no split shares a problem
with another whatever the seeds and sizes; inside a split, problems are distinct and drawn deterministically from
the seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass

from .depth_task import COPY, SPLITS, hash_split, level_stats, token_labels, write_sft

LETTERS = string.ascii_lowercase
# The answer line's text after "#### " (what exact match compares): every restated query with its result.
ANSWER_PATTERN = r"####[ \t]*([0-9a-z][0-9a-z ]*[0-9a-z])"


def _int_field(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class HopTaskSpec:
    """The task's settings: `n_sym` letter pairs (one cycle), `n_queries` queries over distinct letters, hop counts
    1..`max_hops` drawn uniformly."""

    n_sym: int = 8
    n_queries: int = 4
    max_hops: int = 2

    def __post_init__(self):
        _int_field("n_sym", self.n_sym, 3, len(LETTERS))
        _int_field("n_queries", self.n_queries, 1, self.n_sym)
        # π^k(x) != x for k < n_sym (one cycle), so no result is a copy of its query letter
        _int_field("max_hops", self.max_hops, 1, min(9, self.n_sym - 1))

    @property
    def levels(self) -> tuple[str, ...]:
        """The difficulty labels, easiest first: "copy", "1", ..., str(max_hops)."""
        return (COPY, *(str(k) for k in range(1, self.max_hops + 1)))


def render(pairs: Sequence[tuple[str, str]], queries: Sequence[tuple[int, str]]) -> dict:
    """{"question", "answer", "labels"} of the problem with `pairs` [(x, π(x)), ...] in question order and
    `queries` [(k, x), ...]; `labels` has one difficulty label per character of `answer`."""
    pi = dict(pairs)
    if len(pi) != len(pairs) or sorted(pi) != sorted(pi.values()):
        raise ValueError("pairs must list a permutation: every letter once as x and once as π(x)")
    results = []
    for k, x in queries:
        if x not in pi:
            raise ValueError(f"query letter {x!r} is not in the pairs")
        for _ in range(k):
            x = pi[x]
        results.append(x)
    question = " ".join(x + y for x, y in pairs) + ":" + " ".join(f"{k}{x}." for k, x in queries)
    answer = "#### " + " ".join(f"{k}{x}{r}" for (k, x), r in zip(queries, results, strict=True))
    labels = [COPY] * len("#### ")
    for i, (k, _) in enumerate(queries):
        labels += ([COPY] if i else []) + [COPY, COPY, str(k)]
    return {"question": question, "answer": answer, "labels": labels}


def _draw(rng: random.Random, spec: HopTaskSpec) -> dict:
    syms = rng.sample(LETTERS, spec.n_sym)
    cycle = syms[:]
    rng.shuffle(cycle)
    pi = {cycle[i]: cycle[(i + 1) % spec.n_sym] for i in range(spec.n_sym)}
    order = syms[:]
    rng.shuffle(order)
    xs = rng.sample(syms, spec.n_queries)
    ks = [rng.randint(1, spec.max_hops) for _ in xs]
    return render([(x, pi[x]) for x in order], list(zip(ks, xs, strict=True)))


def make_split(split: str, n: int, seed: int = 0, spec: HopTaskSpec | None = None) -> list[dict]:
    """`n` distinct problems of `split` ("train", "validation" or "test"), the same for the same arguments. Each is
    {"question", "answer", "labels"}; `labels` gives every answer character its difficulty label."""
    spec = spec or HopTaskSpec()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    rng = random.Random(f"hop:{seed}:{split}:{spec.n_sym}:{spec.n_queries}:{spec.max_hops}")
    seen, rows, tries = set(), [], 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 10_000:
            raise ValueError(f"cannot draw {n} distinct {split} problems from {spec}: too few exist")
        row = _draw(rng, spec)
        if row["question"] in seen or hash_split(row["question"]) != split:
            continue
        seen.add(row["question"])
        rows.append(row)
    return rows


def answer_length(spec: HopTaskSpec) -> int:
    """Characters of every answer of `spec` (all answers have the same layout)."""
    return len("#### ") + 4 * spec.n_queries - 1


__all__ = ["ANSWER_PATTERN", "COPY", "HopTaskSpec", "LETTERS", "answer_length", "hash_split", "level_stats",
           "make_split", "render", "token_labels", "write_sft"]
