"""The embedded default base (hf_loops/data/base) and the vendored GSM8K problems: they ship, load offline, the base
is a real language model, its chat template marks assistant tokens, and its pretraining script is deterministic."""

import json
import os

import pytest
import torch
from helpers.common import SHARED

from hf_loops.data import (
    EVAL_ROWS,
    GSM8K_PRETRAIN_ANSWER_ROWS,
    default_base_dir,
    gsm8k_path,
    load_gsm8k,
)
from hf_loops.evaluation.examples import extract_answer

CORPUS = os.path.join(SHARED, "data", "corpus")
MAX_WEIGHT_BYTES = 8_000_000


@pytest.fixture(scope="module")
def report():
    with open(os.path.join(default_base_dir(), "pretrain_report.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_base_dir(), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(default_base_dir(), local_files_only=True)
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------------------------ GSM8K
def test_vendored_gsm8k_has_100_problems_with_final_answers():
    rows = load_gsm8k()
    assert len(rows) == 100
    for row in rows:
        assert set(row) == {"id_orig", "question", "answer"}
        assert "\n#### " in row["answer"]
        assert extract_answer(row["answer"]) is not None  # the one answer rule (hf_loops.evaluation)
    assert len(load_gsm8k(EVAL_ROWS)) == 20 and not set(EVAL_ROWS) & set(GSM8K_PRETRAIN_ANSWER_ROWS)
    assert os.path.isfile(os.path.join(os.path.dirname(gsm8k_path()), "README.md"))  # attribution + licence
    shared = os.path.join(SHARED, "data", "gsm8k", "gsm8k_test_100.jsonl")
    if os.path.isfile(shared):
        with open(shared, "rb") as a, open(gsm8k_path(), "rb") as b:
            assert a.read() == b.read()


# --------------------------------------------------------------------------------------------------- shipped base
def test_base_ships_small_and_loads_offline(base, report):
    model, tokenizer = base
    path = os.path.join(default_base_dir(), "model.safetensors")
    assert os.path.getsize(path) <= MAX_WEIGHT_BYTES
    assert model.config.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == getattr(torch, report["save_dtype"])
    assert sum(p.numel() for p in model.parameters()) == report["n_params"]
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == model.config.eos_token_id and tokenizer.pad_token_id == model.config.pad_token_id
    for name in ("README.md", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(default_base_dir(), name))
    assert report["command"] in open(os.path.join(default_base_dir(), "README.md")).read()


def test_base_is_a_language_model(report):
    """The recorded held-out loss (last 1% of each corpus file, never trained on) is far below the unigram baseline."""
    assert report["final"] and report["heldout_loss"]["mean"] < report["unigram_loss"]["mean"] - 2.0
    assert report["eval_curve"][-1][1] < report["eval_curve"][0][1] - 4.0


def test_base_heldout_probe_loss_recomputes(base, report):
    """Recompute a fixed held-out probe from ../shared/data with the shipped weights: the recorded value comes back."""
    if not os.path.isdir(CORPUS):
        pytest.skip("../shared/data/corpus is not present")
    from hf_loops.training.pretrain_base import heldout_probe_loss

    model, tokenizer = base
    loss = heldout_probe_loss(model, tokenizer, CORPUS, report["heldout_fraction"])
    assert loss == pytest.approx(report["heldout_probe_loss"], abs=0.02)
    assert loss < report["unigram_loss"]["mean"] - 2.0


def test_base_predicts_text_it_never_saw(base):
    """No ../shared needed: a sentence written for this test (Python-docs style) is far more likely than chance."""
    model, tokenizer = base
    text = ("The :func:`len` function returns the number of items in a sequence, such as a string, a list or a "
            "tuple. If the argument is not a sequence, a :exc:`TypeError` is raised.\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 3.5  # uniform over 8192 tokens is 9.0 nats, the unigram baseline about 7; the base gives ~2.4


def test_chat_template_marks_assistant_tokens(base):
    _, tokenizer = base
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3=5\n#### 5"}]
    out = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant = tokenizer.decode([i for i, m in zip(ids, mask, strict=False) if m])
    assert assistant == "2+3=5\n#### 5<|im_end|>"
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n2+3=5\n#### 5<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]


# ------------------------------------------------------------------------------------------------- pretrain script
def _corpus_dir(tmp_path):
    """The real corpus when ../shared is present, else a tiny stand-in built from the vendored GSM8K text."""
    if os.path.isdir(CORPUS):
        return CORPUS
    rows = load_gsm8k()
    for name, field in (("shakespeare.txt", "question"), ("python_docs.txt", "answer")):
        (tmp_path / name).write_text("\n".join(r[field] for r in rows))
    return str(tmp_path)


@pytest.mark.slow
def test_pretrain_script_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    from hf_loops.training.pretrain_base import main

    tiny = ["--corpus", _corpus_dir(tmp_path), "--max-chars", "20000", "--tokenizer", default_base_dir(),
            "--hidden-size", "16", "--intermediate-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--seq-len", "32", "--batch-size", "2", "--steps", "3", "--warmup", "1",
            "--threads", "1", "--seed", "7", "--eval-every", "0", "--eval-tokens", "65", "--sample-tokens", "0",
            "--no-progress"]
    runs = []
    for name in ("a", "b"):
        report = main(tiny + ["--out", str(tmp_path / name)])
        runs.append(load_file(tmp_path / name / "model.safetensors"))
        assert report["final"] and report["steps_done"] == 3
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    other = main(tiny + ["--out", str(tmp_path / "c"), "--seed", "8"])
    assert other["n_params"] == report["n_params"]
    assert not torch.equal(load_file(tmp_path / "c" / "model.safetensors")["model.embed_tokens.weight"],
                           runs[0]["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="not empty"):
        main(tiny + ["--out", str(tmp_path / "a")])


def test_bpe_training_is_deterministic():
    from hf_loops.training.pretrain_base import train_tokenizer

    text = "\n".join(f"{r['question']}\n{r['answer']}" for r in load_gsm8k())
    a, b = (train_tokenizer([text], 600) for _ in range(2))
    assert len(a) == 600 and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.decode(a("Natalia sold 48 clips.\n")["input_ids"]) == "Natalia sold 48 clips.\n"
