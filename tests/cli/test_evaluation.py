"""`hf-loops eval` / `hf_loops.evaluation.evaluate`: answers, NLL, depth, FLOPs, batching, CLI, lm-evaluation-harness."""

import json
import math
import os

import pytest
import torch
from helpers.eval_helpers import PROBLEMS, decisive_tah2, tiny_base, write_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_loops.cli import main
from hf_loops.core.flops_tah2 import decode_flops_standard
from hf_loops.evaluation.decoding import tokenize_example
from hf_loops.evaluation.examples import EvalExample, extract_answer, load_examples, parse_split
from hf_loops.evaluation.metrics import evaluate
from hf_loops.evaluation.models import load_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    base = tiny_base(root / "base")
    return {
        "base": base,
        "tah2": decisive_tah2(base, root / "tah2"),
        "standard": decisive_tah2(base, root / "standard", max_iterations=1, decider="never", updater="identity"),
        "data": write_problems(root / "problems.jsonl"),
        "root": root,
    }


@pytest.mark.parametrize("text, want", [
    ("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,234", "1234"), ("#### $18.", "18"), ("#### -3.50", "-3.5"),
    ("#### 5\n#### 6", "6"), ("no marker 12", None),
])
def test_gsm8k_answer_extraction(text, want):
    assert extract_answer(text) == want


def test_other_answer_patterns():
    assert extract_answer("The answer is 42, clearly.", "last-number") == "42"
    assert extract_answer("Answer: B", r"Answer:\s*([A-D])") == "B"
    with pytest.raises(ValueError, match="answer-pattern"):
        extract_answer("x", "([")


def test_split_syntax():
    assert parse_split(None) == ("train", None, None)
    assert parse_split("test[80:]") == ("test", 80, None)
    assert parse_split("train[:-20]") == ("train", None, -20)
    with pytest.raises(ValueError, match="--split"):
        parse_split("train[a:b]")


def test_dataset_formats_and_errors(tmp_path):
    rows = [{"question": "q1", "answer": "a\n#### 1"},
            {"prompt": [{"role": "user", "content": "q2"}], "completion": [{"role": "assistant", "content": "#### 2"}]},
            {"messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "#### 3"}]},
            {"prompt": "q4 ", "completion": "#### 4"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex = load_examples(str(path))
    assert [extract_answer(e.reference) for e in ex] == ["1", "2", "3", "4"]
    assert ex[2].prompt == [{"role": "user", "content": "q3"}]
    assert len(load_examples(str(path), "train[1:3]")) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):  # one format for every reader: FILE:LINE
        load_examples(str(bad))
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected the fields"):
        load_examples(str(bad))


def test_completion_tokens_are_the_assistant_turn(ckpts):
    tok = AutoTokenizer.from_pretrained(ckpts["base"])
    ex = EvalExample([{"role": "user", "content": PROBLEMS[0][0]}], [{"role": "assistant", "content": PROBLEMS[0][1]}],
                     PROBLEMS[0][1])
    prompt, answer = tokenize_example(tok, ex)
    full = tok.apply_chat_template(ex.prompt + ex.completion, tokenize=True, return_dict=True)["input_ids"]
    assert prompt + answer == list(full)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert tok.decode(answer) == PROBLEMS[0][1] + "<|im_end|>\n"


def _same(a, b):
    """Every per-example number of two evaluations agrees (NLL to float noise)."""
    assert len(a["examples"]) == len(b["examples"])
    for x, y in zip(a["examples"], b["examples"], strict=False):
        assert x["generated_text"] == y["generated_text"] and x["correct"] == y["correct"]
        assert x["answer_nll"] == pytest.approx(y["answer_nll"], abs=1e-4)
        for key in ("answer_depths", "generated_depths", "decode_flops"):
            assert x.get(key) == y.get(key), key


@pytest.mark.parametrize("which", ["tah2", "base"])
@pytest.mark.slow
def test_left_padded_batch_equals_per_row_loop(ckpts, which):
    kw = dict(dataset=ckpts["data"], max_new_tokens=10, progress=False, decider_accuracy=False)
    batched = evaluate(ckpts[which], batch_size=4, **kw)
    rows = evaluate(ckpts[which], batch_size=1, **kw)
    _same(batched, rows)
    if which == "tah2":
        depths = [d for e in batched["examples"] for d in e["answer_depths"]]
        assert 1 in depths and 2 in depths  # the check covers mixed depths
        gen = [d for e in batched["examples"] for d in e["generated_depths"]]
        assert set(gen) <= {1, 2}


def test_metrics_standard_vs_qwen3_and_flops_accounting(ckpts):
    kw = dict(dataset=ckpts["data"], max_new_tokens=6, progress=False, batch_size=8)
    std = evaluate(ckpts["standard"], **kw)
    qwen = evaluate(ckpts["base"], **kw)
    tah = evaluate(ckpts["tah2"], **kw)
    # Standard (M = 1) is Qwen3 with the same weights: same NLL, generations and FLOPs.
    assert std["name"] == "Standard (M=1)" and qwen["name"] == "Qwen3" and tah["name"] == "TaH2 (M=2)"
    assert std["metrics"]["answer_nll"] == pytest.approx(qwen["metrics"]["answer_nll"], abs=1e-5)
    assert std["metrics"]["decode_flops_per_token"] == pytest.approx(qwen["metrics"]["decode_flops_per_token"])
    model, tok = load_model(ckpts["standard"])
    for ex, e in zip(load_examples(ckpts["data"]), std["examples"], strict=False):
        P = len(tokenize_example(tok, ex)[0])
        assert e["decode_flops"] == decode_flops_standard(model.config, P, e["generated_tokens"] - 1)
    m = tah["metrics"]
    assert m["perplexity"] == pytest.approx(math.exp(m["answer_nll"]))
    hist = m["depth_histogram"]
    assert sum(hist.values()) == m["answer_tokens"]
    assert m["mean_depth"] == pytest.approx((hist["1"] + 2 * hist["2"]) / m["answer_tokens"])
    assert m["continue_rate"]["1"] == pytest.approx(hist["2"] / m["answer_tokens"])
    assert 0.0 <= m["decider_accuracy"]["1"] <= 1.0 and m["decider_decisions"]["1"] == m["answer_tokens"]
    assert sum(s["tokens"] for s in m["depth_by_class"].values()) == m["answer_tokens"] - len(PROBLEMS)  # no EOS
    assert m["tokens_per_s"] > 0 and m["decode_flops_per_token"] > std["metrics"]["decode_flops_per_token"]
    # a plain Qwen3 is one pass: depth 1 on every token, as the Standard TaH2 model (M = 1) reports
    for key in ("mean_depth", "mean_depth_generated", "depth_histogram", "continue_rate"):
        assert qwen["metrics"][key] == std["metrics"][key], key
    assert std["metrics"]["mean_depth"] == 1.0 and qwen["metrics"]["mean_depth_generated"] == 1.0


def test_spiralformer_and_sgt_report_nll_answers_and_flops(ckpts):
    from hf_loops.conversion import convert_qwen3

    tok = AutoTokenizer.from_pretrained(ckpts["base"])
    examples = load_examples(ckpts["data"])[:2]
    for arch, kw in (("spiralformer", dict(num_pre_layers=1, num_loop_layers=1, num_post_layers=0,
                                           chunk_sizes=[2, 1])),
                     ("sgt", dict(loop_plan=[{"layer": 1, "heads": [0, 1], "depth": 1}]))):
        model = convert_qwen3(ckpts["base"], arch, **kw).eval()
        r = evaluate(model, tok, examples=examples, max_new_tokens=4, progress=False)
        m = r["metrics"]
        assert r["model_type"] == arch and m["answer_nll"] > 0 and m["decode_flops_per_token"] > 0
        assert "mean_depth" not in m


@pytest.mark.slow
def test_cli_eval_writes_outputs_and_refuses_bad_input(ckpts, tmp_path, capsys):
    out = tmp_path / "ev"
    argv = ["eval", ckpts["tah2"], "--baseline", ckpts["standard"], "--dataset", ckpts["data"], "--split",
            "train[:4]", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Standard (M=1)" in printed and "TaH2 (M=2)" in printed
    files = set(os.listdir(out))
    assert {"eval.json", "eval.md", "depth_map.html", "depth_map.png", "depth_by_token_class.png"} <= files
    data = json.loads((out / "eval.json").read_text())
    assert [r["name"] for r in data["results"]] == ["Standard (M=1)", "TaH2 (M=2)"]
    assert data["command"].startswith("hf-loops eval ")
    md = (out / "eval.md").read_text()
    assert "| TaH2 (M=2) |" in md and "decode FLOPs/token ÷ Standard (M=1)" in md
    # a non-empty --out is refused (one line, exit 2) and left alone; --overwrite replaces it
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0] and "--overwrite" in err[0]
    assert main(argv + ["--overwrite", "--no-decider-accuracy"]) == 0
    assert "decider_accuracy" not in json.loads((out / "eval.json").read_text())["results"][1]["metrics"]
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n[1, 2]\n')
    assert main(["eval", ckpts["tah2"], "--dataset", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2: expected a JSON object" in err[0]
    assert not (tmp_path / "x").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".x.tmp")]
    assert main(["eval", str(tmp_path / "missing"), "--dataset", ckpts["data"], "--out", str(tmp_path / "y")]) == 2


# ----------------------------------------------------------------------------------------------------- lm-eval
LL_REQUESTS = [("Question: Tom has 3 apples and buys 4 more.\nAnswer:", " 3 + 4 = 7"),
               ("A box holds", " 12 pens."),
               ("Half of 18 birds fly away.", " 9 stay.")]
GEN_REQUESTS = [("Question: Tom has 3 apples and buys 4 more.\nAnswer:", ["\n", "Question:"]),
                ("A box holds", ["."]),
                ("Half of 18 birds", ["birds"])]


def _loglikelihood_one(model, tok, context, continuation):
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), -1)
    picked = logp.gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)
    return float(picked.sum()), bool((logp.argmax(-1) == torch.tensor(cont)).all())


def _generate_one(model, tok, context, until, max_new_tokens=8):
    ids = tok(context, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


def test_exported_tah2_loads_and_runs_like_lm_eval_harness_calls_it(ckpts):
    """What lm-evaluation-harness's `hf` model type does, without the package: AutoModelForCausalLM with
    trust_remote_code, right-padded loglikelihood batches, left-padded generate_until batches with stop strings."""
    model = AutoModelForCausalLM.from_pretrained(ckpts["tah2"], trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "TaH2ForCausalLM"
    tok = AutoTokenizer.from_pretrained(ckpts["tah2"], trust_remote_code=True)
    # loglikelihood: a right-padded batch of (context + continuation) == each request alone
    pairs = [(tok(c, add_special_tokens=False)["input_ids"], tok(c + x, add_special_tokens=False)["input_ids"])
             for c, x in LL_REQUESTS]
    width = max(len(w) for _, w in pairs)
    ids = torch.full((len(pairs), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (_, w) in enumerate(pairs):
        ids[i, :len(w)] = torch.tensor(w)
        mask[i, :len(w)] = 1
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
    for i, ((c, w), req) in enumerate(zip(pairs, LL_REQUESTS, strict=False)):
        cont = torch.tensor(w[len(c):])
        got = float(logp[i, len(c) - 1:len(w) - 1].gather(-1, cont[:, None]).sum())
        assert got == pytest.approx(_loglikelihood_one(model, tok, *req)[0], abs=1e-4)
    # generate_until: a left-padded batch with stop strings == each request alone
    tok.padding_side = "left"
    enc = tok([c for c, _ in GEN_REQUESTS], return_tensors="pt", padding=True, add_special_tokens=False)
    stops = sorted({s for _, u in GEN_REQUESTS for s in u})
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, stop_strings=stops, tokenizer=tok,
                             pad_token_id=tok.pad_token_id)
    for i, (c, until) in enumerate(GEN_REQUESTS):
        text = tok.decode(out[i, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for stop in until:
            text = text.split(stop)[0]
        assert text == _generate_one(model, tok, c, until)


@pytest.mark.slow
def test_lm_evaluation_harness_with_a_local_task(ckpts, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval)")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS[:4]))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hfl.yaml").write_text(f"""task: hfl_tiny_gsm
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  do_sample: false
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    lm = HFLM(pretrained=ckpts["tah2"], trust_remote_code=True, batch_size=2, device="cpu", dtype="float32")
    assert type(lm.model).__name__ == "TaH2ForCausalLM"
    tasks = TaskManager(include_defaults=False, include_path=str(tmp_path / "tasks"))  # only the local task file
    res = lm_eval.simple_evaluate(model=lm, tasks=["hfl_tiny_gsm"], task_manager=tasks, bootstrap_iters=0,
                                  log_samples=True)
    assert "exact_match,none" in res["results"]["hfl_tiny_gsm"]
    tok = AutoTokenizer.from_pretrained(ckpts["tah2"])
    for sample in res["samples"]["hfl_tiny_gsm"]:
        context = sample["arguments"][0][0]
        assert sample["resps"][0][0] == _generate_one(lm.model, tok, context, ["\n", "Question:"])
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i)
                            for i, r in enumerate(LL_REQUESTS)])
    for (ll, greedy), req in zip(got, LL_REQUESTS, strict=False):
        want_ll, want_greedy = _loglikelihood_one(lm.model, tok, *req)
        assert ll == pytest.approx(want_ll, abs=1e-4) and greedy == want_greedy
