"""A seeded depth-bound task: fixed-width addition written most significant digit first, labelled by carry reach.

One problem, `digits = 4`:

    question: 4721+3278
    answer:   4721+3278=07999
              #### 7999

The answer restates the operands (copied tokens), then writes the sum zero-padded to `digits + 1` digits, most
significant first, then the GSM8K-style answer line `#### N` (copied again), so the package's default answer pattern
scores it and `hf-loops train --dataset` reads the rows as they are (`question` / `answer`).

Why it needs depth: a result digit of column k (0 = units) is (a_k + b_k + carry_k) mod 10, and the carry into
column k is decided by the first column below k whose digit sum is not 9: a sum >= 10 sends a carry, a sum <= 8 none,
a sum of exactly 9 passes on whatever comes from below. Written most significant digit first, the digits already
written are of higher columns and say nothing about the columns below, so the model has to look
`reach(k) = min(k, 1 + run9(k-1))` columns down (run9(j): the length of the run of 9-sums from column j downwards);
a longer reach is a longer chain of dependent lookups. The difficulty level of a result digit is
`1 + reach`: level "1" is the units digit (its own column only), level "2" a digit decided by the column just below,
level "3" one whose column below sums to 9, and so on up to `digits + 1` (the leading 0/1 over a run of 9-sums down
to the units). Every other answer character (restated operands, "+", "=", the answer line) is "copy".

`nine_prob` makes a column's two digits sum to 9 more often than uniform digits do (1 in 10), so the long reaches
are common enough to train and to measure.

Splits: a problem (a, b) belongs to one split by a stable hash of "a+b" (`split_of`), so no split shares a problem
with another whatever the seeds and sizes; inside a split, problems are distinct and drawn deterministically from
the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

SPLITS = ("train", "validation", "test")
COPY = "copy"


@dataclass(frozen=True)
class DepthTaskSpec:
    """The task's settings: `digits`-digit operands (zero-padded, so every problem has the same layout), and the
    probability `nine_prob` that a column's digit pair is drawn to sum to exactly 9 (else the two digits are
    uniform)."""

    digits: int = 4
    nine_prob: float = 0.3

    def __post_init__(self):
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 2 <= self.digits <= 8:
            raise ValueError(f"digits must be an integer in [2, 8], got {self.digits!r}")
        if isinstance(self.nine_prob, bool) or not isinstance(self.nine_prob, (int, float)) \
                or not 0.0 <= self.nine_prob <= 1.0:
            raise ValueError(f"nine_prob must be a number in [0, 1], got {self.nine_prob!r}")

    @property
    def levels(self) -> tuple[str, ...]:
        """The difficulty labels, easiest first: "copy", "1", ..., str(digits + 1)."""
        return (COPY, *(str(k) for k in range(1, self.digits + 2)))


def hash_split(text: str) -> str:
    """The split of the problem written `text`: a stable hash (sha256) of it, modulo 3 (train 0, validation 1,
    test 2)."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return SPLITS[h % 3]


def split_of(a: int, b: int) -> str:
    """The split a problem belongs to: `hash_split` of "a+b"."""
    return hash_split(f"{a}+{b}")


def reaches(a: int, b: int, digits: int) -> list[int]:
    """reach(k) for the result columns k = 0..digits (index k): how many columns below k decide its carry."""
    s = [(a // 10 ** j) % 10 + (b // 10 ** j) % 10 for j in range(digits)]
    out = [0]
    for k in range(1, digits + 1):
        r, j = 1, k - 1
        while s[j] == 9 and j > 0:
            r, j = r + 1, j - 1
        out.append(r)
    return out


def render(a: int, b: int, digits: int) -> dict:
    """{"question", "answer", "labels"}: `labels` has one difficulty label per character of `answer`."""
    x, y, c = f"{a:0{digits}d}", f"{b:0{digits}d}", f"{a + b:0{digits + 1}d}"
    head = f"{x}+{y}="
    tail = f"\n#### {a + b}"
    r = reaches(a, b, digits)
    result_labels = [str(1 + r[digits - i]) for i in range(digits + 1)]  # c is written from column `digits` down
    return {"question": f"{x}+{y}", "answer": head + c + tail,
            "labels": [COPY] * len(head) + result_labels + [COPY] * len(tail)}


def _draw(rng: random.Random, spec: DepthTaskSpec) -> tuple[int, int]:
    a = b = 0
    for j in range(spec.digits):
        x = rng.randrange(10)
        y = 9 - x if rng.random() < spec.nine_prob else rng.randrange(10)
        a += x * 10 ** j
        b += y * 10 ** j
    return a, b


def make_split(split: str, n: int, seed: int = 0, spec: DepthTaskSpec | None = None) -> list[dict]:
    """`n` distinct problems of `split` ("train", "validation" or "test"), the same for the same arguments. Each is
    {"question", "answer", "labels", "a", "b"}; `labels` gives every answer character its difficulty label."""
    spec = spec or DepthTaskSpec()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    # the seed stream is split-specific too, so the three splits of one seed are not filtered copies of one stream
    rng = random.Random(f"{seed}:{split}:{spec.digits}:{spec.nine_prob}")
    seen, rows, tries = set(), [], 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 10_000:
            raise ValueError(f"cannot draw {n} distinct {split} problems from {spec}: too few exist")
        a, b = _draw(rng, spec)
        if (a, b) in seen or split_of(a, b) != split:
            continue
        seen.add((a, b))
        rows.append({**render(a, b, spec.digits), "a": a, "b": b})
    return rows


def token_labels(tokens: Sequence[str], answer: str, labels: Sequence[str]) -> list[str]:
    """The difficulty label of each answer token (its decoded text, in order, covering `answer` and possibly a
    trailing special token): the label of its first non-space character; tokens past the answer text, all-space
    tokens and special tokens are "copy"."""
    if len(labels) != len(answer):
        raise ValueError(f"labels must have one entry per answer character ({len(answer)}), got {len(labels)}")
    out, pos = [], 0
    for t in tokens:
        idx = next((pos + i for i, ch in enumerate(t) if not ch.isspace()), None)
        ok = idx is not None and idx < len(answer) and answer[pos:pos + len(t)] == t
        out.append(labels[idx] if ok else COPY)
        pos += len(t)
    return out


def write_sft(path: str, rows: Sequence[dict]) -> str:
    """Write `rows` as SFT JSON Lines (`{"question", "answer"}` per line), the format `hf-loops train --dataset` and
    `hf-loops eval --dataset` read; returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows)
    return path


def write_depth_splits(out_dir: str, sizes: dict[str, int], seed: int = 0, spec: DepthTaskSpec | None = None
                 ) -> dict[str, str]:
    """`make_split` for each split in `sizes` ({split: n}), written as `<out_dir>/<split>.jsonl`; also
    `<split>.labels.jsonl` (the difficulty labels, one list per line). Returns {split: path}."""
    paths = {}
    for split, n in sizes.items():
        rows = make_split(split, n, seed, spec)
        paths[split] = write_sft(os.path.join(out_dir, f"{split}.jsonl"), rows)
        with open(os.path.join(out_dir, f"{split}.labels.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r["labels"]) + "\n" for r in rows)
    return paths


def level_stats(items: Sequence[dict]) -> dict[str, dict]:
    """Per difficulty label: tokens, accuracy (where "correct" is given per token) and the share of deep tokens
    (depth >= 2, where "depths" is given), over items {"labels": [...], "correct"?: [...], "depths"?: [...]}."""
    sums: dict[str, list[int]] = {}
    for e in items:
        for k, lab in enumerate(e["labels"]):
            s = sums.setdefault(lab, [0, 0, 0, 0, 0])
            s[0] += 1
            if "correct" in e:
                s[1] += int(bool(e["correct"][k]))
                s[3] += 1
            if "depths" in e:
                s[2] += int(e["depths"][k] >= 2)
                s[4] += 1
    return {lab: {"tokens": n, "accuracy": c / nc if nc else None, "deep_share": d / nd if nd else None}
            for lab, (n, c, d, nc, nd) in sorted(sums.items(), key=lambda kv: (kv[0] != COPY, kv[0]))}


__all__ = ["COPY", "SPLITS", "DepthTaskSpec", "hash_split", "level_stats", "make_split", "reaches", "render", "split_of",
           "token_labels", "write_sft", "write_depth_splits"]
