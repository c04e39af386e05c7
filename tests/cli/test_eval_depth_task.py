"""`hf-loops eval CKPT --task depth --data-seed N --n K --json`: generated depth-task problems scored by the evaluation
machinery, one JSON object out; checked against a direct forward pass and a direct `generate` of one problem."""

import json

import pytest
import torch
from helpers.eval_helpers import decisive_tah2, tiny_base, write_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_loops.cli import main
from hf_loops.data.depth_task import DepthTaskSpec, level_stats, token_labels
from hf_loops.evaluation.examples import extract_answer
from hf_loops.evaluation.tasks import DEPTH_SUMMARY_FIELDS, depth_task_run

FIELDS = {"exact_match", "answer_nll", "mean_depth", "generated_depth", "decode_flops_ratio", "train_time_ratio",
          "by_difficulty"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_depth")
    base = tiny_base(root / "qwen3")  # a plain Qwen3: what a Standard run saves
    return {
        "qwen3": base,
        "tah2": decisive_tah2(base, root / "tah2"),
        "standard": decisive_tah2(base, root / "standard", max_iterations=1, decider="never", updater="identity"),
        "data": write_problems(root / "problems.jsonl", n=2),
        "root": root,
    }


def run_json(capsys, ckpt, *extra):
    capsys.readouterr()
    assert main(["eval", ckpt, "--task", "depth", "--json", "--no-progress", *extra]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1, out  # ONE JSON object, nothing else on stdout
    return json.loads(out)


@pytest.mark.parametrize("arch", ["tah2", "qwen3"])
def test_the_json_has_exactly_the_fields_with_values_in_range(ckpts, capsys, arch):
    got = run_json(capsys, ckpts[arch], "--n", "6", "--data-seed", "1")
    assert set(got) == FIELDS == set(DEPTH_SUMMARY_FIELDS)
    assert 0.0 <= got["exact_match"] <= 1.0
    assert got["answer_nll"] > 0
    M = 2 if arch == "tah2" else 1
    assert 1.0 <= got["mean_depth"] <= M and 1.0 <= got["generated_depth"] <= M
    assert got["decode_flops_ratio"] >= 1.0
    assert got["train_time_ratio"] is None
    levels = got["by_difficulty"]
    assert list(levels) == list(DepthTaskSpec().levels)  # "copy", "1", ..., "5": every level of the spec, in order
    assert levels["copy"]["tokens"] > 0
    for s in levels.values():
        assert set(s) == {"accuracy", "deep_share", "tokens"}
        if s["tokens"]:
            assert 0.0 <= s["accuracy"] <= 1.0 and 0.0 <= s["deep_share"] <= 1.0
        else:
            assert s["accuracy"] is None and s["deep_share"] is None
    if arch == "qwen3":
        assert all(s["deep_share"] in (0.0, None) for s in levels.values())


def test_the_levels_follow_the_spec(ckpts, capsys):
    got = run_json(capsys, ckpts["qwen3"], "--n", "3", "--digits", "3", "--nine-prob", "0.9")
    assert list(got["by_difficulty"]) == ["copy", "1", "2", "3", "4"] == list(DepthTaskSpec(digits=3).levels)


@pytest.mark.parametrize("arch", ["qwen3", "standard"])
def test_standard_runs_one_pass_and_costs_the_standard_formula(ckpts, capsys, arch):
    got = run_json(capsys, ckpts[arch], "--n", "4")
    assert got["mean_depth"] == 1.0 and got["generated_depth"] == 1.0
    assert got["decode_flops_ratio"] == pytest.approx(1.0, rel=1e-12)
    if arch == "qwen3":
        assert got["decode_flops_ratio"] == 1.0  # the very same formula at the same lengths


def test_the_data_seed_picks_the_problems(ckpts, capsys, tmp_path):
    assert depth_task_run(5, seed=3).rows() == depth_task_run(5, seed=3).rows()
    assert [r["question"] for r in depth_task_run(5, seed=3).rows()] != [
        r["question"] for r in depth_task_run(5, seed=4).rows()]
    # through the command: the same seed, the same numbers; and the problems it scored (eval.json with --out)
    assert run_json(capsys, ckpts["tah2"], "--n", "4", "--data-seed", "3") == run_json(
        capsys, ckpts["tah2"], "--n", "4", "--data-seed", "3")
    questions = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        run_json(capsys, ckpts["qwen3"], "--n", "4", "--data-seed", seed, "--out", str(tmp_path / name))
        with open(tmp_path / name / "eval.json", encoding="utf-8") as f:
            questions[name] = [e["question"] for e in json.load(f)["results"][0]["examples"]]
    assert questions["a"] == questions["b"] == [r["question"] for r in depth_task_run(4, seed=3).rows()]
    assert questions["a"] != questions["c"]


def test_one_problem_by_hand(ckpts, capsys):
    """--n 1 against the model called directly: the teacher-forced NLL and per-token argmax hits of the reference
    answer, and a greedy `generate` whose `#### N` decides exact match."""
    path = ckpts["qwen3"]
    got = run_json(capsys, path, "--n", "1", "--data-seed", "7")
    run = depth_task_run(1, seed=7)
    row = run.rows()[0]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    user = [{"role": "user", "content": row["question"]}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": row["answer"]}], tokenize=True,
                                   return_dict=True)["input_ids"]
    assert full[:len(prompt)] == prompt
    answer = full[len(prompt):]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0, len(prompt) - 1:-1].float(), -1)
        gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=run.max_new_tokens(), do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    target = torch.tensor(answer)
    nll = -logp.gather(-1, target[:, None]).squeeze(-1)
    assert got["answer_nll"] == pytest.approx(nll.mean().item(), rel=1e-5)
    labels = token_labels([tok.decode([t]) for t in answer], row["answer"], row["labels"])
    hits = (logp.argmax(-1) == target).tolist()
    want = level_stats([{"labels": labels, "correct": hits, "depths": [1] * len(answer)}])
    for level, s in got["by_difficulty"].items():
        if level in want:
            assert s == {"accuracy": want[level]["accuracy"], "deep_share": 0.0, "tokens": want[level]["tokens"]}
        else:
            assert s["tokens"] == 0
    pred = extract_answer(tok.decode(gen[0, len(prompt):], skip_special_tokens=True))
    assert extract_answer(row["answer"]) == str(row["a"] + row["b"])  # the reference's `#### N` is the sum
    assert got["exact_match"] == float(pred == str(row["a"] + row["b"]))


def test_without_json_it_prints_the_table(ckpts, capsys):
    capsys.readouterr()
    assert main(["eval", ckpts["tah2"], "--baseline", ckpts["qwen3"], "--task", "depth", "--n", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "exact match (#### N)" in out and "TaH2 (M=2)" in out and "÷ Qwen3" in out
    assert "0/2" in out or "1/2" in out or "2/2" in out


@pytest.mark.parametrize("args, flag", [
    (["--task", "depth", "--n", "0"], "--n must be an integer >= 1"),
    (["--task", "arithmetic"], "--task must be one of: depth"),
    (["--task", "depth", "--digits", "9"], "--digits must be an integer in [2, 8]"),
    (["--task", "depth", "--nine-prob", "1.5"], "--nine-prob must be a number in [0, 1]"),
    (["--task", "depth", "--data-seed", "-1"], "--data-seed must be an integer >= 0"),
    (["--task", "depth", "--split", "dev"], "--split"),
    (["--task", "depth", "--json", "--baseline", "BASE"], "--baseline"),
    (["--task", "depth", "--dataset", "DATA"], "--dataset"),
    (["--task", "depth", "--answer-pattern", "last-number"], "--answer-pattern"),
    (["--n", "5", "--dataset", "DATA", "--out", "OUT"], "--n: only with --task"),
    (["--json", "--dataset", "DATA", "--out", "OUT"], "--json: only with --task"),
    ([], "--dataset is required"),
])
def test_bad_input_is_one_line_naming_the_flag(ckpts, capsys, tmp_path, args, flag):
    args = [{"BASE": ckpts["qwen3"], "DATA": ckpts["data"], "OUT": str(tmp_path / "o")}.get(a, a) for a in args]
    capsys.readouterr()
    assert main(["eval", ckpts["tah2"], *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], err
    assert out == "" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("wrong", [(), (0,), (1,)])
def test_a_model_forced_to_known_answers_scores_them(ckpts, capsys, monkeypatch, wrong):
    """A plain Qwen3 whose `generate` writes each problem's reference answer (and, for the problems in `wrong`, a sum
    off by one): exact match is the share written right, and the decode cost is the Standard formula's."""
    from types import SimpleNamespace

    from transformers import Qwen3ForCausalLM

    rows = depth_task_run(3, seed=11).rows()
    tok = AutoTokenizer.from_pretrained(ckpts["qwen3"])

    def forced(self, input_ids, attention_mask=None, max_new_tokens=None, pad_token_id=None, **kw):
        out = []
        for ids in input_ids:
            text = tok.decode(ids, skip_special_tokens=False)
            k = next(i for i, r in enumerate(rows) if f"{r['question']}<|im_end|>" in text)
            r = rows[k]
            answer = r["answer"] if k not in wrong else r["answer"].replace(f"#### {r['a'] + r['b']}",
                                                                            f"#### {r['a'] + r['b'] + 1}")
            gen = tok(answer, add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [tok.eos_token_id]
            out.append(ids.tolist() + gen)
        width = max(len(o) for o in out)
        return SimpleNamespace(sequences=torch.tensor([o + [pad_token_id] * (width - len(o)) for o in out]))

    monkeypatch.setattr(Qwen3ForCausalLM, "generate", forced)
    got = run_json(capsys, ckpts["qwen3"], "--n", "3", "--data-seed", "11")
    assert got["exact_match"] == pytest.approx(1 - len(wrong) / 3)
    assert got["generated_depth"] == 1.0 and got["decode_flops_ratio"] == 1.0
