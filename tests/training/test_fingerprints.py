"""Tokenizer fingerprints for `datasets` (hf_loops.training.fingerprints): the hash leaves out the Python-side copies
of the vocabulary and merges that the backend tokenizer holds, and stays a function of the tokenizer's content."""

import os

import pytest
from datasets.fingerprint import Hasher
from transformers import AutoTokenizer

from hf_loops.training.fingerprints import DERIVED, register_tokenizer_fingerprint


@pytest.fixture
def qwen_tokenizer_dir(shared_dir):
    return os.path.join(shared_dir, "data", "qwen3-tokenizer")


@pytest.mark.slow
def test_fingerprint_follows_the_content_and_leaves_the_tokenizer_as_it_was(qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    assert all(k in vars(tok) for k in DERIVED)  # the Python-side copies the hash skips
    vocab, ids = tok._vocab, tok("Natalia sold 48 clips.").input_ids
    assert register_tokenizer_fingerprint(tok) and register_tokenizer_fingerprint(tok)  # idempotent
    first = Hasher.hash(tok)
    assert tok._vocab is vocab and tok("Natalia sold 48 clips.").input_ids == ids  # put back after hashing
    assert Hasher.hash(AutoTokenizer.from_pretrained(qwen_tokenizer_dir)) == first  # same content, same hash
    added = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    added.add_tokens(["<extra_token_for_the_test>"])
    left = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    left.padding_side = "left"
    template = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    template.chat_template = "{{ messages[0]['content'] }}"
    assert len({first, Hasher.hash(added), Hasher.hash(left), Hasher.hash(template)}) == 4


def test_a_tokenizer_without_python_copies_is_left_to_datasets():
    from hf_loops.data import default_base_dir

    tok = AutoTokenizer.from_pretrained(default_base_dir())
    assert not any(k in vars(tok) for k in DERIVED)
    assert register_tokenizer_fingerprint(tok) is False
    assert register_tokenizer_fingerprint(None) is False


def test_the_tah2_trainer_registers_its_tokenizer(qwen_tokenizer_dir, tmp_path):
    from datasets import Dataset
    from datasets.utils._dill import Pickler
    from helpers.tah2_helpers import tiny_tah2

    from hf_loops.training import TaH2SFTConfig, TaH2SFTTrainer, fingerprints

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    Pickler.dispatch.pop(type(tok), None)  # whatever an earlier test registered
    fingerprints._REGISTERED.discard(type(tok))
    data = Dataset.from_list([{"prompt": "1 + 1 =", "completion": " 2"}])
    args = TaH2SFTConfig(output_dir=str(tmp_path), report_to=[], max_length=16, use_cpu=True)
    TaH2SFTTrainer(model=tiny_tah2(qwen_overrides={"vocab_size": len(tok)}, max_iterations=2), args=args, train_dataset=data,
                   processing_class=tok)
    assert Pickler.dispatch[type(tok)].__name__ == "save_without_derived"
