"""Builders for the evaluation / depth-map / demo tests: a tiny byte-level BPE tokenizer with a ChatML template, a tiny
random Qwen3 base saved with it, and a small GSM8K-style JSONL file. Everything offline and in well under a second."""

import json
import os

import torch

from hf_loops.training.pretrain_base import CHAT_TEMPLATE

CHATML = CHAT_TEMPLATE  # the embedded base's template (one copy)

PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7 apples.\n#### 7"),
    ("A box holds 12 pens. How many pens are in 2 boxes?", "12 * 2 = <<12*2=24>>24 pens.\n#### 24"),
    ("Sara had 10 dollars and spent 6. How much is left?", "10 - 6 = <<10-6=4>>4 dollars.\n#### 4"),
    ("There are 5 cats with 4 legs each. How many legs?", "5 * 4 = <<5*4=20>>20 legs.\n#### 20"),
    ("Ben reads 7 pages a day for 3 days. How many pages?", "7 * 3 = <<7*3=21>>21 pages.\n#### 21"),
    ("Half of 18 birds fly away. How many stay?", "18 / 2 = <<18/2=9>>9 birds.\n#### 9"),
    ("Amy has 2 bags of 6 sweets and eats 5. How many are left?",
     "2 * 6 = <<2*6=12>>12 sweets.\n12 - 5 = <<12-5=7>>7 sweets.\n#### 7"),
    ("A train travels 30 miles an hour for 2 hours. How far does it go?", "30 * 2 = <<30*2=60>>60 miles.\n#### 60"),
]


def write_problems(path, n=None):
    rows = PROBLEMS if n is None else (PROBLEMS * (n // len(PROBLEMS) + 1))[:n]
    with open(path, "w", encoding="utf-8") as f:
        for q, a in rows:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return str(path)


def tiny_tokenizer(vocab_size=320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [q + "\n" + a for q, a in PROBLEMS] * 4 + ["user assistant system"]
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def tiny_base(path, seed=0, hidden=32, layers=2):
    """A tiny random Qwen3 + the tiny tokenizer saved to `path`; returns the directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def decisive_tah2(base_dir, out_dir, seed=1, scale=3.0, **overrides):
    """Convert the base to TaH2 with a widened decider (g far from τ: mixed, stable depths) and export it."""
    from transformers import AutoTokenizer

    from hf_loops.conversion import convert_qwen3, export

    model = convert_qwen3(base_dir, "tah2", **overrides).eval()
    if model.decider is not None:
        with torch.no_grad():
            torch.manual_seed(seed)
            model.decider.score.weight.normal_(0.0, scale)
    export(model, str(out_dir), tokenizer=AutoTokenizer.from_pretrained(base_dir))
    return str(out_dir)


def exists_nonempty(path):
    return os.path.isfile(path) and os.path.getsize(path) > 0
