"""hf_loops.data.hop_task: determinism, disjoint splits, hand-computed results and labels, the answer pattern,
bad input."""

import random
import re

import pytest

from hf_loops.data import hop_task as H
from hf_loops.data.depth_task import hash_split
from hf_loops.evaluation.examples import extract_answer


def test_same_seed_same_problems_other_seed_other_problems():
    assert H.make_split("train", 50, seed=3) == H.make_split("train", 50, seed=3)
    assert H.make_split("train", 50, seed=3) != H.make_split("train", 50, seed=4)
    spec = H.HopTaskSpec(n_sym=5, n_queries=2, max_hops=3)
    assert H.make_split("test", 20, 0, spec) != H.make_split("test", 20, 0)


def test_splits_are_disjoint_and_distinct_inside():
    spec = H.HopTaskSpec(n_sym=3, n_queries=1, max_hops=2)  # few problems: collisions would show
    keys = {}
    for split in H.SPLITS:
        rows = H.make_split(split, 300, seed=0, spec=spec)
        q = {r["question"] for r in rows}
        assert len(q) == len(rows)
        assert all(hash_split(x) == split for x in q)
        keys[split] = q
    other = {r["question"] for r in H.make_split("validation", 300, seed=7, spec=spec)}
    assert not other & keys["train"] and not other & keys["test"]
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]


def test_hand_computed_problem():
    # one cycle q→f→t→a→q, its pairs listed in the order given
    pairs = [("q", "f"), ("t", "a"), ("f", "t"), ("a", "q")]
    r = H.render(pairs, [(2, "q"), (1, "t"), (3, "a")])
    assert r["question"] == "qf ta ft aq:2q. 1t. 3a."
    # π²(q) = π(f) = t; π(t) = a; π³(a) = π²(q) = t
    assert r["answer"] == "#### 2qt 1ta 3at"
    assert r["labels"] == ["copy"] * 5 + ["copy", "copy", "2", "copy", "copy", "copy", "1", "copy", "copy", "copy",
                                          "3"]
    assert extract_answer(r["answer"], H.ANSWER_PATTERN) == "2qt 1ta 3at"
    assert len(r["answer"]) == H.answer_length(H.HopTaskSpec(n_sym=4, n_queries=3, max_hops=3))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_problems_follow_their_permutation(seed):
    rng = random.Random(seed)
    spec = H.HopTaskSpec(n_sym=rng.randint(3, 12), n_queries=1, max_hops=2)
    spec = H.HopTaskSpec(n_sym=spec.n_sym, n_queries=rng.randint(1, spec.n_sym), max_hops=rng.randint(1, 2))
    for r in H.make_split("train", 100, seed, spec):
        head, tail = r["question"].split(":")
        pi = dict(tuple(p) for p in head.split(" "))
        assert len(pi) == spec.n_sym and set(pi.values()) == set(pi)
        # one cycle: from any letter, n_sym steps come back and no fewer do
        x = next(iter(pi))
        orbit = [x]
        while pi[orbit[-1]] != x:
            orbit.append(pi[orbit[-1]])
        assert len(orbit) == spec.n_sym
        queries = [(int(q[0]), q[1]) for q in tail.split(" ")]
        assert all(q.endswith(".") for q in tail.split(" "))
        assert len({x for _, x in queries}) == len(queries) == spec.n_queries
        expect = []
        for k, x in queries:
            y = x
            for _ in range(k):
                y = pi[y]
            assert y != x
            expect.append(f"{k}{x}{y}")
        assert r["answer"] == "#### " + " ".join(expect)
        assert len(r["labels"]) == len(r["answer"]) == H.answer_length(spec)
        assert [lab for lab in r["labels"] if lab != "copy"] == [str(k) for k, _ in queries]
        assert set(r["labels"]) <= set(spec.levels)
        # every result sits after its restated query letter; every copied character repeats the question's
        assert all(r["answer"][i] == (" " if i % 4 == 0 else r["answer"][i])
                   for i in range(4, len(r["answer"])))


def test_both_hop_counts_are_common():
    rows = H.make_split("train", 400, seed=0)
    labs = [lab for r in rows for lab in r["labels"] if lab != "copy"]
    assert 0.4 < labs.count("2") / len(labs) < 0.6


def test_answer_pattern_reads_the_answer_line_only():
    assert extract_answer("#### 2qe 1ta\n<junk>", H.ANSWER_PATTERN) == "2qe 1ta"
    assert extract_answer("no answer line", H.ANSWER_PATTERN) is None
    assert re.compile(H.ANSWER_PATTERN)


@pytest.mark.parametrize("kw, field", [({"n_sym": 2}, "n_sym"), ({"n_sym": 27}, "n_sym"), ({"n_sym": True}, "n_sym"),
                                       ({"n_queries": 0}, "n_queries"), ({"n_queries": 9}, "n_queries"),
                                       ({"max_hops": 0}, "max_hops"), ({"n_sym": 4, "max_hops": 4}, "max_hops"),
                                       ({"max_hops": 2.0}, "max_hops")])
def test_bad_spec_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field} must be an integer in \["):
        H.HopTaskSpec(**kw)


def test_bad_split_and_size_and_render():
    with pytest.raises(ValueError, match="split must be one of"):
        H.make_split("dev", 3)
    with pytest.raises(ValueError, match="n must be an integer"):
        H.make_split("train", -1)
    with pytest.raises(ValueError, match="permutation"):
        H.render([("a", "b"), ("b", "b")], [(1, "a")])
    with pytest.raises(ValueError, match="not in the pairs"):
        H.render([("a", "b"), ("b", "a")], [(1, "c")])
