"""SGT (Sparse Growing Transformer on Qwen3) as a vLLM model, for vLLM's CPU backend.

SGT's loop structure is static (the config's `loop_plan`, or the Block Loop baseline's `block_loop_layers`), so every
token runs the same passes and each pass is a plain causal attention over the whole sequence:

* head loops (`loop_mode="heads"`): layer l's attention sub-layer is re-applied `depth` extra times, each loop
  re-reading the stream the previous one updated; only the kept heads' outputs enter W_O (the others have gate 0);
* Block Loop (`loop_mode="block"`): the whole block of a listed layer is applied `1 + block_loop_depth` times.

Every extra attention call is one of vLLM's own `Attention` layers with its own paged KV slot (same block table as
the base pass), so vLLM's kernels, continuous batching, chunked prefill and prefix caching apply as for any model.
A head loop runs every head through the kernel and keeps the kept heads' outputs: every slot then has the base
layer's KV shape (one KV cache spec for the whole model, which vLLM's allocator needs), at the price of computing
the dropped heads too (a sliced kernel call would need slots of other shapes).

Only SGT's configuration is imported from hf_loops (it imports under the transformers version vLLM pins); the
backbone is written here on plain torch layers with Qwen3's weight names (SGT adds no parameters).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_loops.modeling.configuration_sgt import SGTConfig
from hf_loops.serving.vllm_tah2 import (
    _MLP,
    Linear,
    RMSNorm,
    _Qwen3Attention,
    check_engine,
    load_checkpoint_weights,
    use_cpu_gemm,
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


class _SGTAttention(_Qwen3Attention):
    def __init__(self, config, extra: int, cache_config, prefix: str):
        # call 0: the base pass; call k ≥ 1: the k-th head loop or Block Loop repeat, each with its own KV slot
        super().__init__(config, cache_config, prefix, [f"attn_loop{k}" for k in range(1, 1 + extra)])

    def forward(self, x, positions, call: int, heads: list[int] | None = None):
        n = x.shape[0]
        q, k, v = self._qkv(x, positions)
        out = self.attn[call](q.reshape(n, -1).contiguous(), k.reshape(n, -1).contiguous(),
                              v.reshape(n, -1).contiguous())
        if heads is None:
            return self.o_proj(out)
        # a head loop: only the kept heads' outputs enter W_O (column slice of the shared weight)
        cols = self._columns(heads, out.device)
        return F.linear(out.index_select(1, cols), self.o_proj.weight.index_select(1, cols), self.o_proj.bias)

    def _columns(self, heads, device):
        key = (tuple(heads), str(device))
        if getattr(self, "_cols_key", None) != key:
            self._cols = torch.tensor([h * self.D + i for h in heads for i in range(self.D)], device=device)
            self._cols_key = key
        return self._cols


class _SGTDecoderLayer(nn.Module):
    def __init__(self, config, extra: int, heads, block: bool, cache_config, prefix):
        super().__init__()
        self.extra, self.heads, self.block = extra, heads, block
        self.self_attn = _SGTAttention(config, extra, cache_config, f"{prefix}.self_attn")
        self.mlp = _MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _block(self, x, positions, call):
        x = x + self.self_attn(self.input_layernorm(x), positions, call)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, positions):
        if self.block:  # Block Loop: the whole block again, one KV slot per repeat
            for call in range(1 + self.extra):
                x = self._block(x, positions, call)
            return x
        x = x + self.self_attn(self.input_layernorm(x), positions, 0)
        for k in range(1, self.extra + 1):  # head loops re-read the stream they update; the MLP runs once, after
            x = x + self.self_attn(self.input_layernorm(x), positions, k, self.heads)
        return x + self.mlp(self.post_attention_layernorm(x))


class _SGTBackbone(nn.Module):
    def __init__(self, config, cache_config, prefix):
        super().__init__()
        block = config.loop_mode == "block"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            _SGTDecoderLayer(config, extra, heads, block, cache_config, f"{prefix}.layers.{i}")
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
    """vLLM model class for `SGTForCausalLM` checkpoints (tensor parallel size 1)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_sgt_servable(config)
        check_engine(vllm_config, "SGT")
        self.config = config
        self.model = _SGTBackbone(config, vllm_config.cache_config, "model" if not prefix else f"{prefix}.model")
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(e, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_checkpoint_weights(self, weights, "SGT")
        # a head loop multiplies by column slices of W_O: those layers keep the unpacked weight
        use_cpu_gemm(self, keep_weight={layer.self_attn.o_proj for layer in self.model.layers if layer.heads})
        return loaded
