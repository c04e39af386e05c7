"""hf_loops.data.depth_task: determinism, disjoint splits, hand-computed carry-reach labels, bad input."""

import json

import pytest

from hf_loops.data import depth_task as D


def test_same_seed_same_problems_other_seed_other_problems():
    assert D.make_split("train", 50, seed=3) == D.make_split("train", 50, seed=3)
    assert D.make_split("train", 50, seed=3) != D.make_split("train", 50, seed=4)


def test_splits_are_disjoint_and_distinct_inside():
    spec = D.DepthTaskSpec(digits=2, nine_prob=0.3)  # 10^4 problems: small enough that collisions would show
    keys = {}
    for split in D.SPLITS:
        rows = D.make_split(split, 600, seed=0, spec=spec)
        k = {(r["a"], r["b"]) for r in rows}
        assert len(k) == len(rows)
        assert all(D.split_of(a, b) == split for a, b in k)
        keys[split] = k
    # other seeds draw other problems but never cross a split
    other = {(r["a"], r["b"]) for r in D.make_split("validation", 600, seed=9, spec=spec)}
    assert not other & keys["train"] and not other & keys["test"]
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]


def test_hand_computed_labels():
    # 4721+3278: column sums (units first) 9, 9, 9, 7 → 07999. Column 4's carry is decided by column 3 (sum 7):
    # reach 1; column 3 looks through the 9-sums of columns 2 and 1 down to column 0: reach 3; column 2: reach 2;
    # column 1: reach 1 (column 0 has nothing below it); column 0: reach 0.
    r = D.render(4721, 3278, 4)
    assert r["question"] == "4721+3278"
    assert r["answer"] == "4721+3278=07999\n#### 7999"
    assert r["labels"][10:15] == ["2", "4", "3", "2", "1"]
    assert r["labels"][:10] == ["copy"] * 10 and r["labels"][15:] == ["copy"] * 10
    # 0999+0001: sums 10, 9, 9, 0 → 01000; column 4 looks at column 3 (sum 0): reach 1; column 3 looks through
    # columns 2, 1 to column 0 (sum 10, a carry): reach 3; column 2: reach 2; column 1: reach 1.
    assert D.render(999, 1, 4)["labels"][10:15] == ["2", "4", "3", "2", "1"]
    assert D.render(999, 1, 4)["answer"].startswith("0999+0001=01000")
    # 5000+4999: sums 9, 9, 9, 9 → 09999: column 4 looks through all four columns: level 5 (the hardest)
    assert D.render(5000, 4999, 4)["labels"][10:15] == ["5", "4", "3", "2", "1"]
    # 12+34 (2 digits): sums 6, 4 → 046: reaches 1, 1, 0
    assert D.render(12, 34, 2)["labels"][6:9] == ["2", "2", "1"]
    assert D.reaches(5000, 4999, 4) == [0, 1, 2, 3, 4]


def test_labels_follow_the_sum():
    for r in D.make_split("train", 200, seed=1):
        assert len(r["labels"]) == len(r["answer"])
        assert r["answer"].endswith(f"#### {r['a'] + r['b']}")
        assert set(r["labels"]) <= set(D.DepthTaskSpec().levels)


def test_nine_prob_raises_the_long_reaches():
    def share(p):
        rows = D.make_split("train", 400, seed=0, spec=D.DepthTaskSpec(nine_prob=p))
        labs = [x for r in rows for x in r["labels"] if x != "copy"]
        return sum(x in ("4", "5") for x in labs) / len(labs)

    assert share(0.5) > 3 * share(0.0)


def test_token_labels():
    r = D.render(4721, 3278, 4)
    tokens = list("4721+3278=07999") + ["\n", "####", " ", "7", "9", "9", "9", "<|im_end|>"]
    labs = D.token_labels(tokens, r["answer"], r["labels"])
    assert labs[10:15] == ["2", "4", "3", "2", "1"]
    assert labs[-1] == "copy" and labs[:10] == ["copy"] * 10
    with pytest.raises(ValueError, match="labels must have one entry"):
        D.token_labels(tokens, r["answer"], r["labels"][:-1])


def test_write_splits(tmp_path):
    paths = D.write_depth_splits(str(tmp_path), {"train": 5, "validation": 3}, seed=0)
    rows = [json.loads(line) for line in open(paths["train"])]
    assert len(rows) == 5 and set(rows[0]) == {"question", "answer"}
    labels = [json.loads(line) for line in open(tmp_path / "validation.labels.jsonl")]
    assert len(labels) == 3 and len(labels[0]) == len(D.make_split("validation", 3, 0)[0]["answer"])


def test_level_stats():
    items = [{"labels": ["copy", "2", "2"], "correct": [1, 1, 0], "depths": [1, 2, 2]}]
    s = D.level_stats(items)
    assert s["copy"] == {"tokens": 1, "accuracy": 1.0, "deep_share": 0.0}
    assert s["2"] == {"tokens": 2, "accuracy": 0.5, "deep_share": 1.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"digits": 1}, "digits must be an integer in \\[2, 8\\]"),
    ({"digits": 9}, "digits must be"),
    ({"digits": 4.0}, "digits must be"),
    ({"nine_prob": -0.1}, "nine_prob must be a number in \\[0, 1\\]"),
    ({"nine_prob": 1.5}, "nine_prob must be"),
    ({"nine_prob": True}, "nine_prob must be"),
])
def test_bad_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.DepthTaskSpec(**kwargs)


def test_bad_split_and_n():
    with pytest.raises(ValueError, match="split must be one of \\('train', 'validation', 'test'\\)"):
        D.make_split("heldout", 3)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        D.make_split("train", -1)
    with pytest.raises(ValueError, match="too few exist"):
        D.make_split("train", 10_000, spec=D.DepthTaskSpec(digits=2, nine_prob=1.0))
