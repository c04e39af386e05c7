"""The seeded GSM8K-formatted arithmetic task: determinism, disjoint splits, correct answers, token classes."""

import random
import re

import pytest

from hf_loops.data import arithmetic as A
from hf_loops.evaluation.examples import extract_answer

STEP = re.compile(r"(\d+)([-+*])(\d+)=<<(\d+)([-+*])(\d+)=(\d+)>>(\d+)")


def _key(row):
    return tuple(m.group(1, 2, 3) for m in STEP.finditer(row["answer"]))


def test_same_seed_same_rows_other_seed_other_rows():
    assert A.generate(50, seed=3) == A.generate(50, seed=3)
    assert A.generate(50, seed=3) != A.generate(50, seed=4)
    assert A.splits(20, 5, 5, seed=1) == A.splits(20, 5, 5, seed=1)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_splits_share_no_problem(seed):
    s = A.splits(300, 40, 40, seed=seed)
    assert [len(s[k]) for k in A.SPLITS] == [300, 40, 40]
    keys = {k: {_key(r) for r in rows} for k, rows in s.items()}
    assert sum(len(v) for v in keys.values()) == 380  # distinct within and across splits
    questions = [r["question"] for rows in s.values() for r in rows]
    for a, b in (("train", "validation"), ("train", "heldout"), ("validation", "heldout")):
        assert not keys[a] & keys[b]
    assert len(set(questions)) == len(questions)


def _check_row(row):
    steps = [m.groups() for m in STEP.finditer(row["answer"])]
    assert steps, row
    prev = None
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    for a, op, b, a2, op2, b2, c, c2 in steps:
        assert (a, op, b) == (a2, op2, b2) and c == c2
        assert int(c) == ops[op](int(a), int(b)) >= 0
        if prev is not None:
            assert int(a) == prev  # a chain: each step starts from the previous result
        prev = int(c)
    assert A.answer_value(row["answer"]) == prev
    assert extract_answer(row["answer"]) == str(prev)  # the evaluator reads the same answer
    assert str(steps[0][0]) in row["question"] and str(steps[0][2]) in row["question"]


@pytest.mark.parametrize("seed", range(6))
def test_answers_are_correct_over_specs(seed):
    rng = random.Random(seed)
    digits = rng.randint(1, 4)
    spec = A.TaskSpec(digits=digits, factor_digits=rng.randint(1, digits), max_steps=rng.randint(1, 4),
                      operators=tuple(rng.sample(A.OPERATORS, rng.randint(1, 3))))
    for row in A.generate(40, seed=seed, spec=spec):
        _check_row(row)


def test_carry_columns_by_hand():
    assert A.carry_columns(47, "+", 38) == {1}        # 7+8 = 15 carries into the tens
    assert A.carry_columns(55, "+", 55) == {1, 2}     # 110: the hundreds digit is only the carry
    assert A.carry_columns(12, "+", 34) == set()
    assert A.carry_columns(85, "-", 19) == {1}        # 5-9 borrows from the tens
    assert A.carry_columns(100, "-", 1) == {1}        # 99: the borrow reaches the tens (the hundreds are gone)
    assert A.carry_columns(47, "*", 3) == {1, 2}      # 141
    assert A.carry_columns(12, "*", 3) == set()       # 36
    assert A.carry_columns(25, "*", 4) == {1, 2}      # 100


@pytest.mark.parametrize("seed", range(4))
def test_carry_columns_match_schoolbook_sweep(seed):
    rng = random.Random(seed)
    for _ in range(300):
        a, b = rng.randint(1, 9999), rng.randint(1, 999)
        # schoolbook addition / subtraction, column by column
        carry, want = 0, set()
        for k in range(len(str(a + b))):
            if carry:
                want.add(k)
            carry = (a // 10 ** k % 10 + b // 10 ** k % 10 + carry) // 10
        assert A.carry_columns(a, "+", b) == want
        if a > b:
            borrow, want = 0, set()
            for k in range(len(str(a - b))):
                if borrow:
                    want.add(k)
                borrow = int(a // 10 ** k % 10 - b // 10 ** k % 10 - borrow < 0)
            assert A.carry_columns(a, "-", b) == want


def test_char_and_token_classes():
    text = "Tom has 47+38=<<47+38=85>>85 pens.\n#### 85"
    cls = A.char_classes(text)
    at = {i: cls[i] for i in range(len(text))}
    inner = text.index("=85>>") + 1
    assert at[inner] == "carry digits" and at[inner + 1] == "result digits"  # 8 gets the carry of 7+8, 5 none
    assert at[text.index("47")] == "copied digits"
    assert at[text.index(">>85") + 2] == "copied digits"
    assert at[text.index("####")] == "operators" and at[text.index("<<")] == "operators"
    assert at[0] == "words"
    tokens = ["Tom", " has", " ", "4", "7", "+", "3", "8", "=", "<<", "4", "7", "+", "3", "8", "=", "8", "5", ">>",
              "8", "5", " pens", ".\n", "####", " ", "8", "5", "<|im_end|>"]
    assert "".join(tokens[:-1]) == text
    got = A.token_classes(tokens, [False] * (len(tokens) - 1) + [True])
    assert got[16:18] == ["carry digits", "result digits"]
    assert got[3] == got[19] == got[25] == "copied digits"
    assert got[2] == "words" and got[9] == "operators" and got[-1] == "special"
    items = [{"answer_tokens": tokens, "answer_special": [False] * 27 + [True], "answer_depths": [1] * 16 + [2] * 2
              + [1] * 10}]
    shares = A.class_deep_shares(items)
    assert shares["carry digits"] == {"tokens": 1, "mean_depth": 2.0, "deep_share": 1.0}
    assert shares["copied digits"]["deep_share"] == 0.0 and shares["special"]["tokens"] == 1


def test_bad_spec_and_counts_raise():
    with pytest.raises(ValueError, match="digits"):
        A.TaskSpec(digits=0)
    with pytest.raises(ValueError, match="operators"):
        A.TaskSpec(operators=("/",))
    with pytest.raises(ValueError, match="n_heldout"):
        A.splits(1, 1, -1)
    with pytest.raises(ValueError, match="distinct"):
        A.generate(1000, spec=A.TaskSpec(digits=1, max_steps=1, operators=("+",)))


def test_write_splits(tmp_path):
    paths = A.write_splits(str(tmp_path), n_train=5, n_validation=2, n_heldout=3, seed=2)
    from hf_loops.evaluation.examples import load_examples

    assert [len(load_examples(paths[k])) for k in A.SPLITS] == [5, 2, 3]
