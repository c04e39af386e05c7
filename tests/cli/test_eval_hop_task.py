"""`hf-loops eval CKPT --task hop --data-seed N --n K --json`: generated hop-task problems scored by the evaluation
machinery, one JSON object out; exact match compares the whole answer line, checked with forced generations."""

import json

import pytest
import torch
from helpers.eval_helpers import decisive_tah2, tiny_base
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_loops.cli import main
from hf_loops.data.hop_task import HopTaskSpec
from hf_loops.evaluation.examples import extract_answer
from hf_loops.evaluation.tasks import DEPTH_SUMMARY_FIELDS, hop_task_run


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_hop")
    base = tiny_base(root / "qwen3")
    return {"qwen3": base, "tah2": decisive_tah2(base, root / "tah2")}


def run_json(capsys, ckpt, *extra):
    capsys.readouterr()
    assert main(["eval", ckpt, "--task", "hop", "--json", "--no-progress", *extra]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1, out
    return json.loads(out)


@pytest.mark.parametrize("arch", ["tah2", "qwen3"])
def test_the_json_has_the_fields_and_the_hop_levels(ckpts, capsys, arch):
    got = run_json(capsys, ckpts[arch], "--n", "5", "--data-seed", "2")
    assert set(got) == set(DEPTH_SUMMARY_FIELDS)
    assert 0.0 <= got["exact_match"] <= 1.0 and got["answer_nll"] > 0
    M = 2 if arch == "tah2" else 1
    assert 1.0 <= got["mean_depth"] <= M and got["decode_flops_ratio"] >= 1.0
    assert list(got["by_difficulty"]) == ["copy", "1", "2"] == list(HopTaskSpec().levels)
    # every result letter is labelled by its hop count: 5 problems x 4 queries = 20 result tokens at most
    # (the tiny tokenizer may merge characters; a merged token takes its hardest character's label)
    results = got["by_difficulty"]["1"]["tokens"] + got["by_difficulty"]["2"]["tokens"]
    assert 0 < results <= 20
    if arch == "qwen3":
        assert all(s["deep_share"] in (0.0, None) for s in got["by_difficulty"].values())


def test_the_spec_flags_set_the_problems(ckpts, capsys, tmp_path):
    got = run_json(capsys, ckpts["qwen3"], "--n", "3", "--n-sym", "5", "--n-queries", "2", "--max-hops", "3",
                   "--out", str(tmp_path / "o"))
    assert list(got["by_difficulty"]) == ["copy", "1", "2", "3"]
    with open(tmp_path / "o" / "eval.json", encoding="utf-8") as f:
        questions = [e["question"] for e in json.load(f)["results"][0]["examples"]]
    want = hop_task_run(3, n_sym=5, n_queries=2, max_hops=3).rows()
    assert questions == [r["question"] for r in want]
    assert all(q.count(".") == 2 and len(q.split(":")[0].split()) == 5 for q in questions)
    assert run_json(capsys, ckpts["qwen3"], "--n", "3", "--data-seed", "4") == run_json(
        capsys, ckpts["qwen3"], "--n", "3", "--data-seed", "4")


@pytest.mark.parametrize("wrong", [(), (1,), (0, 2)])
def test_exact_match_is_the_whole_answer_line(ckpts, capsys, monkeypatch, wrong):
    """A Qwen3 whose `generate` writes each reference answer, with ONE result letter changed in the problems in
    `wrong`: one wrong hop among four fails the problem."""
    from types import SimpleNamespace

    from transformers import Qwen3ForCausalLM

    rows = hop_task_run(3, seed=11).rows()
    tok = AutoTokenizer.from_pretrained(ckpts["qwen3"])

    def corrupt(answer):
        last = answer[-1]
        return answer[:-1] + ("a" if last != "a" else "b")

    def forced(self, input_ids, attention_mask=None, max_new_tokens=None, pad_token_id=None, **kw):
        out = []
        for ids in input_ids:
            text = tok.decode(ids, skip_special_tokens=False)
            k = next(i for i, r in enumerate(rows) if f"{r['question']}<|im_end|>" in text)
            answer = rows[k]["answer"] if k not in wrong else corrupt(rows[k]["answer"])
            gen = tok(answer, add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [tok.eos_token_id]
            out.append(ids.tolist() + gen)
        width = max(len(o) for o in out)
        return SimpleNamespace(sequences=torch.tensor([o + [pad_token_id] * (width - len(o)) for o in out]))

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", forced)
    got = run_json(capsys, ckpts["qwen3"], "--n", "3", "--data-seed", "11")
    assert got["exact_match"] == pytest.approx(1 - len(wrong) / 3)


def test_the_answer_pattern_reads_the_whole_line():
    run = hop_task_run(1)
    row = run.rows()[0]
    assert extract_answer(row["answer"], run.answer_pattern) == row["answer"][len("#### "):]
    assert extract_answer("junk\n" + row["answer"] + "\n", run.answer_pattern) == row["answer"][len("#### "):]
    assert run.max_new_tokens() == len(row["answer"]) + 1


def test_one_problem_greedy_by_hand(ckpts, capsys):
    path = ckpts["qwen3"]
    got = run_json(capsys, path, "--n", "1", "--data-seed", "7")
    run = hop_task_run(1, seed=7)
    row = run.rows()[0]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=run.max_new_tokens(), do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    pred = extract_answer(tok.decode(gen[0, len(prompt):], skip_special_tokens=True), run.answer_pattern)
    assert got["exact_match"] == float(pred == extract_answer(row["answer"], run.answer_pattern))


@pytest.mark.parametrize("args, flag", [
    (["--task", "hop", "--n-sym", "2"], "--n-sym must be an integer in [3, 26]"),
    (["--task", "hop", "--n-queries", "9"], "--n-queries must be an integer in [1, 8]"),
    (["--task", "hop", "--max-hops", "0"], "--max-hops must be an integer in [1, 7]"),
    (["--task", "hop", "--digits", "4"], "--digits: only with --task depth"),
    (["--task", "depth", "--max-hops", "3"], "--max-hops: only with --task hop"),
    (["--task", "hop", "--split", "dev"], "--split with --task hop"),
    (["--task", "hop", "--answer-pattern", "last-number"], "--answer-pattern"),
    (["--n-sym", "5", "--dataset", "D", "--out", "O"], "--n-sym: only with --task"),
])
def test_bad_input_is_one_line_naming_the_flag(ckpts, capsys, tmp_path, args, flag):
    capsys.readouterr()
    assert main(["eval", ckpts["qwen3"], *[{"O": str(tmp_path / "o")}.get(a, a) for a in args]]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], err
    assert out == "" and not (tmp_path / "o").exists()
