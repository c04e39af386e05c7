"""A 64-token character-level tokenizer for the depth-bound base (saved beside the weights, loaded by AutoTokenizer).

Why not the embedded 8k BPE tokenizer: at width 128 its LM head (8192 × 128) costs 2.4× the one-layer backbone per
token, and a training step of the 1-layer model took 0.35 s at batch 64 (60 steps in 21 s, measured); the post-
training runs of the demo must take ~30–40 s each. The task's text is digits, "+", "=", "#", space, newline and the
chat template's words, so one token per character costs nothing in sequence length (the embedded tokenizer splits
digits one by one too). The special tokens keep the embedded tokenizer's ids and names (<|endoftext|> 0 = pad,
<|im_start|> 1, <|im_end|> 2 = end of turn), and the chat template is the embedded base's.
"""

from __future__ import annotations

import os
import shutil
import string

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list(string.digits) + list(string.ascii_lowercase) + list(" \n+-*=#.,:?")
VOCAB_SIZE = 64


def build(out_dir: str):
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`; returns the tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_loops.data import default_base_dir

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    for k in range(len(vocab), VOCAB_SIZE):  # unused rows: a round embedding size
        vocab[f"<|unused{k}|>"] = k
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(out_dir, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", model_max_length=512, clean_up_tokenization_spaces=False)
    with open(os.path.join(default_base_dir(), "chat_template.jinja"), encoding="utf-8") as f:
        fast.chat_template = f.read()
    fast.save_pretrained(out_dir)
    shutil.copy(os.path.join(default_base_dir(), "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    return fast
