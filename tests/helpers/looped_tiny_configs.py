"""The four tiny looped configurations that transformers' common tests and our generation checks run on: TaH2 with
M = 1, TaH2 with M = 2 and a learned decider, SpiralFormer (two resolutions) and SGT (a head-loop plan)."""

from __future__ import annotations

import torch

from hf_loops import (
    SGTConfig,
    SGTForCausalLM,
    SGTModel,
    SpiralFormerConfig,
    SpiralFormerForCausalLM,
    SpiralFormerModel,
    TaH2Config,
    TaH2ForCausalLM,
    TaH2Model,
)

QWEN3_TINY = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # transformers' test_num_layers_is_small: at most 2
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

ARCHS: dict[str, dict] = {
    "tah2_m1": dict(config_class=TaH2Config, base=TaH2Model, causal_lm=TaH2ForCausalLM,
                    config=dict(QWEN3_TINY, max_iterations=1)),
    "tah2_m2": dict(config_class=TaH2Config, base=TaH2Model, causal_lm=TaH2ForCausalLM,
                    config=dict(QWEN3_TINY, max_iterations=2, decider="learned")),
    "spiralformer": dict(config_class=SpiralFormerConfig, base=SpiralFormerModel, causal_lm=SpiralFormerForCausalLM,
                         config=dict(QWEN3_TINY, num_pre_layers=1, num_loop_layers=1, num_post_layers=0,
                                     chunk_sizes=[2, 1])),
    "sgt": dict(config_class=SGTConfig, base=SGTModel, causal_lm=SGTForCausalLM,
                config=dict(QWEN3_TINY, loop_plan=[{"layer": 0, "heads": [0, 3], "depth": 2},
                                                   {"layer": 1, "heads": [1], "depth": 1}])),
}


def tiny_causal_lm(arch: str, seed: int = 0, dtype=torch.float64, **overrides):
    """A seeded random `*ForCausalLM` of `arch` in eval mode.

    fp64 keeps near-ties of a random tiny model's logits from flipping a token between two equivalent computations.
    TaH2's fresh decider gives g ≈ 0.5 = τ, where float noise would flip continue decisions: its score weights are
    widened so g stays far from τ (the decider still decides, token by token)."""
    spec = ARCHS[arch]
    torch.manual_seed(seed)
    model = spec["causal_lm"](spec["config_class"](**{**spec["config"], **overrides}))
    decider = getattr(model, "decider", None)
    if decider is not None and hasattr(decider, "score"):
        with torch.no_grad():
            decider.score.weight.normal_(0.0, 3.0)
    return model.to(dtype).eval()
