"""A seeded, GSM8K-formatted arithmetic task in which some tokens need more computation than others.

Every problem is a short word problem solved by a chain of 1..`max_steps` calculator steps written the GSM8K way,
`a+b=<<a+b=c>>c`, ending with the answer line `#### N`:

    question: Mia has 47 pens. She buys 38 more. She then loses 19. How many pens does Mia have now?
    answer:   Mia has 47+38=<<47+38=85>>85 pens.
              Then she has 85-19=<<85-19=66>>66 pens.
              #### 66

The tokenizer of the embedded base splits digits one by one, so each digit is one token. Only the digits of the
result inside `<<...=c>>` are computed (the model has to add, subtract or multiply multi-digit numbers with carries,
most significant digit first); every other digit is a copy (of an operand from the question or of an earlier result)
and the words and operators are format. `char_classes` labels every character with one of `TOKEN_CLASSES`, and
`token_classes` every token, so a report can show where a decider spends depth.

Splits: one seeded stream of distinct problems (two problems are the same when their steps, i.e. operators and
operands, are the same) is cut into train / validation / held-out, so no split shares a problem with another.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Per-token classes, from "needs computation" to "format". A "carry digit" is a computed result digit whose column
# receives a carry (addition, multiplication) or a borrow (subtraction) from the columns to its right; a "result
# digit" is a computed digit whose column receives none.
TOKEN_CLASSES = ("carry digits", "result digits", "copied digits", "operators", "words", "special")
COMPUTED_CLASSES = ("carry digits", "result digits")
OPERATORS = ("+", "-", "*")
_OPERATOR_CHARS = frozenset("+-*/=<>#")
_STEP = re.compile(r"<<(\d+)([-+*])(\d+)=(\d+)>>")

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Lily", "Ben", "Emma", "Noah")
ITEMS = ("pens", "apples", "stickers", "books", "coins", "shells", "cards", "marbles", "eggs", "cookies")
PRONOUNS = {"Mia": "She", "Ava": "She", "Zoe": "She", "Ivy": "She", "Lily": "She", "Emma": "She"}


@dataclass(frozen=True)
class TaskSpec:
    """What one problem may contain: `digits`-digit operands (the second factor of a product has
    `factor_digits`), 1..`max_steps` chained steps, operators from `operators`."""

    digits: int = 2
    factor_digits: int = 1
    max_steps: int = 2
    operators: tuple[str, ...] = OPERATORS

    def __post_init__(self):
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be in [1, 6], got {self.digits}")
        if not 1 <= self.factor_digits <= self.digits:
            raise ValueError(f"factor_digits must be in [1, digits={self.digits}], got {self.factor_digits}")
        if not 1 <= self.max_steps <= 5:
            raise ValueError(f"max_steps must be in [1, 5], got {self.max_steps}")
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators}")


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 2, 10 ** digits - 1)


def _steps(rng: random.Random, spec: TaskSpec) -> list[tuple[int, str, int, int]]:
    """[(a, op, b, a op b)]: the first a is drawn, each later a is the previous result; results stay >= 0."""
    n = rng.randint(1, spec.max_steps)
    x = _number(rng, spec.digits)
    steps = []
    for _ in range(n):
        op = rng.choice(spec.operators)
        if op == "*":
            b = _number(rng, spec.factor_digits)
            c = x * b
        elif op == "+":
            b = _number(rng, spec.digits)
            c = x + b
        else:
            if x < 3:  # nothing sensible to take away: add instead
                op, b = "+", _number(rng, spec.digits)
                c = x + b
            else:
                b = rng.randint(1, min(x - 1, 10 ** spec.digits - 1))
                c = x - b
        steps.append((x, op, b, c))
        x = c
    return steps


def _render(rng: random.Random, steps: Sequence[tuple[int, str, int, int]]) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pron = PRONOUNS.get(name, "He")
    a0, op0, b0, c0 = steps[0]
    if op0 == "*":
        q = [f"{name} has {a0} bags with {b0} {item} in each."]
    else:
        q = [f"{name} has {a0} {item}."]
        q.append(f"{pron} buys {b0} more." if op0 == "+" else f"{pron} gives away {b0}.")
    later = {"+": "{p} then gets {b} more.", "-": "{p} then loses {b}.", "*": "{p} then makes it {b} times as many."}
    q += [later[op].format(p=pron, b=b) for _, op, b, _ in steps[1:]]
    q.append(f"How many {item} does {name} have now?")
    lines = []
    for k, (a, op, b, c) in enumerate(steps):
        calc = f"{a}{op}{b}=<<{a}{op}{b}={c}>>{c}"
        lines.append(f"{name} has {calc} {item}." if k == 0 else f"Then {pron.lower()} has {calc} {item}.")
    lines.append(f"#### {steps[-1][3]}")
    return {"question": " ".join(q), "answer": "\n".join(lines)}


def generate(n: int, seed: int = 0, spec: TaskSpec | None = None) -> list[dict]:
    """`n` distinct problems (GSM8K rows: "question", "answer"), the same for the same seed and spec."""
    spec = spec or TaskSpec()
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen, rows = set(), []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct problems from {spec}: too few exist")
        steps = tuple(_steps(rng, spec))
        key = tuple((a, op, b) for a, op, b, _ in steps)
        if key in seen:
            continue
        seen.add(key)
        rows.append(_render(rng, steps))
    return rows


SPLITS = ("train", "validation", "heldout")


def splits(n_train: int = 400, n_validation: int = 40, n_heldout: int = 40, seed: int = 0,
           spec: TaskSpec | None = None) -> dict[str, list[dict]]:
    """{"train", "validation", "heldout"}: consecutive slices of one stream of distinct problems (none shared)."""
    for name, k in (("n_train", n_train), ("n_validation", n_validation), ("n_heldout", n_heldout)):
        if k < 0:
            raise ValueError(f"{name} must be >= 0, got {k}")
    rows = generate(n_train + n_validation + n_heldout, seed, spec)
    return {"train": rows[:n_train], "validation": rows[n_train:n_train + n_validation],
            "heldout": rows[n_train + n_validation:]}


def write_splits(out_dir: str, **kwargs) -> dict[str, str]:
    """Write `splits(**kwargs)` as `<out_dir>/<split>.jsonl`; returns {split: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, rows in splits(**kwargs).items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


# ----------------------------------------------------------------------------------------------------- classes
def answer_value(text: str) -> int | None:
    """The integer after the last `####`, or None."""
    m = re.findall(r"####\s*(-?\d+)", text)
    return int(m[-1]) if m else None


def carry_columns(a: int, op: str, b: int) -> set[int]:
    """Columns (0 = units) of `a op b` that receive a carry (+, *) or a borrow (-) from the columns to their right."""
    da = [int(c) for c in reversed(str(a))]
    db = [int(c) for c in reversed(str(b))]
    if op == "-":
        return {k for k in range(1, len(str(a - b))) if a % 10 ** k < b % 10 ** k}
    if op == "+":
        col = [(da[k] if k < len(da) else 0) + (db[k] if k < len(db) else 0) for k in range(max(len(da), len(db)))]
    elif op == "*":
        col = [0] * (len(da) + len(db))
        for i, x in enumerate(da):
            for j, y in enumerate(db):
                col[i + j] += x * y
    else:
        raise ValueError(f"op must be one of {OPERATORS}, got {op!r}")
    out, low = set(), 0  # low: the value of the columns right of k, in units of 10**k after the carry is taken
    for k in range(1, len(str(a + b if op == "+" else a * b))):
        low += col[k - 1] * 10 ** (k - 1)
        if low // 10 ** k:
            out.add(k)
    return out


def char_classes(text: str) -> list[str]:
    """One class per character of a GSM8K-style answer (see `TOKEN_CLASSES`): the digits of c in `<<a op b=c>>`
    are computed (carry or result digits); every other digit is copied; `+-*/=<>#` are operators; the rest words."""
    cls = ["copied digits" if ch.isdigit() else "operators" if ch in _OPERATOR_CHARS else "words" for ch in text]
    for m in _STEP.finditer(text):
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        carries = carry_columns(a, op, b)
        start, end = m.span(4)
        for i in range(start, end):
            cls[i] = "carry digits" if (end - 1 - i) in carries else "result digits"
    return cls


def token_classes(tokens: Sequence[str], special: Sequence[bool] | None = None) -> list[str]:
    """The class of each token (its decoded text, in order): the class of its first non-space character in the
    joined text (all-space tokens are words; special tokens are "special")."""
    joined = "".join(tokens)
    cls = char_classes(joined)
    out, pos = [], 0
    for k, t in enumerate(tokens):
        if special is not None and special[k]:
            out.append("special")
        else:
            idx = next((pos + i for i, ch in enumerate(t) if not ch.isspace()), None)
            out.append("words" if idx is None else cls[idx])
        pos += len(t)
    return out


def class_deep_shares(items: Sequence[dict]) -> dict[str, dict]:
    """Per class of `TOKEN_CLASSES`: tokens, mean depth and the share of deep (>= 2 passes) tokens, over evaluation
    items (the "answer_tokens", "answer_special", "answer_depths" of `hf_loops.evaluation.evaluate`)."""
    sums = {c: [0, 0, 0] for c in TOKEN_CLASSES}
    for e in items:
        if "answer_depths" not in e:
            continue
        for c, d in zip(token_classes(e["answer_tokens"], e["answer_special"]), e["answer_depths"], strict=True):
            sums[c][0] += 1
            sums[c][1] += d
            sums[c][2] += d >= 2
    return {c: {"tokens": n, "mean_depth": s / n if n else None, "deep_share": k / n if n else None}
            for c, (n, s, k) in sums.items()}


__all__ = ["COMPUTED_CLASSES", "SPLITS", "TOKEN_CLASSES", "TaskSpec", "answer_value", "carry_columns",
           "char_classes", "class_deep_shares", "generate", "splits", "token_classes", "write_splits"]
