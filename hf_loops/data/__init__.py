"""Small embedded defaults that ship inside the package (licences in each folder's README.md).

- `base/`: the default base model, a tiny Qwen3-architecture causal LM pretrained by
  `hf_loops.training.pretrain_base` on Shakespeare, the Python docs and GSM8K text, with its own 8k byte-level BPE
  tokenizer and a Qwen3-style chat template. Load it with `AutoModelForCausalLM.from_pretrained(default_base_dir())`.
- `hop_base/`: the base of `make demo`'s depth-bound task (`hop_task`), a 2-layer Qwen3 with a 64-character tokenizer
  pretrained from scratch on 1-hop lookup problems by `experiments/depth_bound/hop_pretrain.py` (its README.md: the
  command, steps, tokens, curve). Load it with `AutoModelForCausalLM.from_pretrained(hop_base_dir())`.
- `gsm8k/gsm8k_test_100.jsonl`: 100 GSM8K test problems (MIT).
- `corpus/shakespeare_1m.txt`: the first 1,000,000 characters (38,674 lines) of the complete works of Shakespeare
  (public domain), the text `hf-loops reproduce` trains on.

No network is needed for either.
"""

from __future__ import annotations

import os

DATA_DIR = os.path.dirname(os.path.abspath(__file__))

# Rows of gsm8k_test_100.jsonl (file order) whose answers the embedded base saw during pretraining; the rest
# (EVAL_ROWS) are held out. One fact, one place: the pretraining script imports these.
GSM8K_PRETRAIN_ANSWER_ROWS = range(0, 80)
EVAL_ROWS = range(80, 100)


def default_base_dir() -> str:
    """Directory of the embedded default base model (config, safetensors weights, tokenizer, README)."""
    return os.path.join(DATA_DIR, "base")


def hop_base_dir() -> str:
    """Directory of the embedded 1-hop base of the hop task (config, safetensors weights, tokenizer, README)."""
    return os.path.join(DATA_DIR, "hop_base")


def corpus_path() -> str:
    """Path of the shipped Shakespeare slice (`hf-loops reproduce`'s training and held-out text)."""
    return os.path.join(DATA_DIR, "corpus", "shakespeare_1m.txt")


def gsm8k_path() -> str:
    """Path of the vendored 100 GSM8K test problems (`{"id_orig", "question", "answer"}` per line)."""
    return os.path.join(DATA_DIR, "gsm8k", "gsm8k_test_100.jsonl")


def load_gsm8k(rows: range | None = None) -> list[dict]:
    """The vendored GSM8K problems as dicts, optionally only the given rows (e.g. `EVAL_ROWS`)."""
    from ..core.readers import read_jsonl

    problems = read_jsonl(gsm8k_path(), "vendored GSM8K file")[0]
    return problems if rows is None else [problems[i] for i in rows]


__all__ = [
    "DATA_DIR",
    "EVAL_ROWS",
    "corpus_path",
    "GSM8K_PRETRAIN_ANSWER_ROWS",
    "default_base_dir",
    "gsm8k_path",
    "hop_base_dir",
    "load_gsm8k",
]
