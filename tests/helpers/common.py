"""The tiny Qwen3 config and model every test builds on, and the paths and process facts several tests read."""

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(REPO), "shared")


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3(seed=0, **overrides):
    """A tiny random `Qwen3ForCausalLM` (eval mode) from `tiny_qwen3_config`, seeded: the one tiny-model builder."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).eval()


def umask() -> int:
    """The process's umask (read by setting it and putting it back): the modes new files and folders get."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
