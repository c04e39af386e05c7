"""The Qwen3 backbone pieces the vLLM TaH2 and SGT models are built from, composed as vLLM's own
`vllm/model_executor/models/qwen3.py` (vLLM 0.32): `QKVParallelLinear` / `RowParallelLinear` attention projections,
`MergedColumnParallelLinear` gate/up with `SiluAndMul`, vLLM's `RMSNorm` (also the per-head q/k norms), `get_rope`, one
vLLM `Attention` layer per paged KV slot, `VocabParallelEmbedding`, `ParallelLMHead` + `LogitsProcessor`. Every layer
gets the engine's `quant_config` and its checkpoint `prefix`, so vLLM's quantized linear methods and its per-platform
kernels (CPU GEMM packing, CUDA kernels) apply exactly as for its own Qwen3; nothing here calls a platform kernel.

Two differences from vLLM's Qwen3, both for parity with hf_loops' HF models: the residual adds are plain tensor adds
(`x + f(norm(x))`, HF's order of rounding, not the fused add-norm), and `o_proj` carries `attention_bias` as HF's
Qwen3 does.

Weights load through vLLM's `stacked_params_mapping` / `weight_loader` pattern (`load_weights`): a checkpoint's
`q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj` go into their shard of the fused parameter through the layer's
own `weight_loader` (which also shards them for tensor parallelism and fills quantization scales).
"""

from __future__ import annotations

import torch.nn as nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

__all__ = ["PACKED_MODULES_MAPPING", "Qwen3Attention", "Qwen3MLP", "RMSNorm", "check_engine", "load_weights", "use_vllm_layers"]

# (fused parameter, checkpoint projection, shard id), as vLLM's Qwen2/Qwen3 loaders: only under the backbone
# (`model.`), so the TaH2 updater/decider's own `gate_proj`/`up_proj` (unfused, `TaH2SwiGLU`) keep their names
STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
PACKED_MODULES_MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def check_engine(vllm_config, name: str, tensor_parallel_refusal: str | None = None) -> None:
    """Refuse the engine settings a looped model is not built for (one line each). `tensor_parallel_refusal`: why
    this configuration cannot run with tensor_parallel_size > 1 (None: it can)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(f"{name} in vLLM: only pipeline_parallel_size=1 is supported (the loop re-runs every layer)")
    tp = parallel.tensor_parallel_size
    if tp != 1 and tensor_parallel_refusal is not None:
        raise ValueError(f"{name} in vLLM: tensor_parallel_size={tp} is not supported: {tensor_parallel_refusal}")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(f"{name} in vLLM: kv_cache_dtype must be 'auto', got {vllm_config.cache_config.cache_dtype!r}")
    check_int8_activations(vllm_config, name)


def int8_activation_schemes(quant_config) -> bool:
    """Does a compressed-tensors config quantize some layer's weights *and* inputs to int8 (W8A8 int8)?"""
    for scheme in getattr(quant_config, "target_scheme_map", {}).values():
        weights, inputs = scheme.get("weights"), scheme.get("input_activations")
        if weights is not None and inputs is not None and weights.num_bits == inputs.num_bits == 8 \
                and str(getattr(weights.type, "value", weights.type)) == "int":
            return True
    return False


def check_int8_activations(vllm_config, name: str, amx: bool | None = None) -> None:
    """Refuse, in one line, a W8A8 int8 checkpoint served in float32 on a CPU with AMX: there vLLM 0.32 runs its int8
    linear layers with its AMX kernel (`check_cpu_sgl_kernel`), which takes only bf16/fp16 activations and fails at
    the first step ("expect A to be bfloat16 or half"), for its own Qwen3 as for these models. `amx`: whether this
    CPU has AMX tiles (None: ask torch)."""
    import torch
    from vllm.platforms import current_platform

    quant = getattr(vllm_config, "quant_config", None)
    if quant is None or vllm_config.model_config.dtype != torch.float32 or not current_platform.is_cpu():
        return
    if amx is None:
        amx = torch.cpu._is_amx_tile_supported()
    if amx and int8_activation_schemes(quant):
        raise ValueError(f"{name} in vLLM: a W8A8 int8 checkpoint needs dtype='bfloat16' or 'float16' on this CPU "
                         "(AMX): vLLM runs its int8 linear layers there with its AMX kernel, which takes bf16/fp16 "
                         "activations, not float32")


def check_heads(config, name: str) -> None:
    """Tensor parallelism splits the query heads and the KV heads across ranks (as vLLM's Qwen3 asserts)."""
    tp = get_tensor_model_parallel_world_size()
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    if H % tp or (Hkv % tp if Hkv >= tp else tp % Hkv):
        raise ValueError(f"{name} in vLLM: tensor_parallel_size={tp} does not divide the {H} attention heads and "
                         f"{Hkv} KV heads")


class Qwen3MLP(nn.Module):
    """vLLM's Qwen2/Qwen3 MLP: fused gate/up projection, SiluAndMul, down projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class Qwen3Attention(nn.Module):
    """vLLM's Qwen3 attention projections, q/k norms and rotary embedding, with one vLLM `Attention` (one paged KV
    slot) per name in `slots` (the first is `{prefix}.attn`); TaH2 and SGT subclass it and differ in how they use
    the slots. Head counts are this rank's (tensor parallel)."""

    def __init__(self, config, cache_config, quant_config, prefix: str, slots: list[str]):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.total_num_heads, self.total_num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = self.total_num_heads // tp
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.head_offset = get_tensor_model_parallel_rank() * self.num_heads  # this rank's first query head
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        d, bias = config.hidden_size, config.attention_bias
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, self.total_num_heads, self.total_num_kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, d, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.attn = nn.ModuleList(
            Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                      cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.{name}")
            for name in ["attn", *slots])

    def qkv(self, x, positions):
        """q (n, H·D), k and v (n, Hkv·D) after the q/k norms and the rotary embedding (as vLLM's Qwen3)."""
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(*q.shape[:-1], self.num_heads, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(*k.shape[:-1], self.num_kv_heads, self.head_dim)).reshape(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v.contiguous()

    def output(self, out):
        out, _ = self.o_proj(out)
        return out


class DecoderLayer(nn.Module):
    """Qwen3's pre-norm block with vLLM's layers: x + attn(norm(x)), then x + mlp(norm(x)); the attention module
    (a `Qwen3Attention` subclass) and what its forward takes are the looped model's."""

    def __init__(self, config, self_attn: nn.Module, quant_config, prefix: str):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention(self, x, *args, **kwargs):
        return x + self.self_attn(self.input_layernorm(x), *args, **kwargs)

    def feed_forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


def use_vllm_layers(module: nn.Module, prefix: str) -> None:
    """Swap the leaf layers of one of hf_loops' own modules (TaH2's updater and decider, whose forward is the HF
    model's code) for vLLM's: every transformers RMSNorm for vLLM's `RMSNorm`, every `nn.Linear` for a replicated
    vLLM linear layer that returns only its output (unquantized: they are small and not in a quantized checkpoint's
    scheme). Parameter names stay, so do the checkpoint names; the weights are loaded afterwards."""
    for name, child in list(module.named_children()):
        path = f"{prefix}.{name}"
        if type(child).__name__ == "Qwen3RMSNorm":
            setattr(module, name, RMSNorm(child.weight.shape[0], eps=child.variance_epsilon))
        elif type(child) is nn.Linear:
            setattr(module, name, ReplicatedLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                                   return_bias=False, prefix=path))
        else:
            use_vllm_layers(child, path)


def load_weights(model: nn.Module, weights, arch: str, skip=lambda name: False) -> set[str]:
    """Load a checkpoint the way vLLM's Qwen2/Qwen3 `load_weights` does: a backbone projection that is fused here
    goes through the fused layer's `weight_loader` with its shard id (`STACKED_PARAMS_MAPPING`), everything else
    through its parameter's `weight_loader` (vLLM's default copy where it has none). The tied `lm_head`, the rotary
    caches some exports carry and `skip(name)` are left out; an unknown name is refused, and so is a fused parameter
    the checkpoint fills only in part. vLLM's attention layers' own scale parameters are not checkpoint weights (vLLM
    initialises them), so they count as loaded."""
    params = dict(model.named_parameters())
    shards: dict[str, set] = {}  # fused parameter → shard ids loaded
    expected = {".qkv_proj": {"q", "k", "v"}, ".gate_up_proj": {0, 1}}
    loaded = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if skip(name):
            continue
        for param_name, shard_name, shard_id in STACKED_PARAMS_MAPPING if name.startswith("model.") else ():
            if shard_name not in name:
                continue
            target = name.replace(shard_name, param_name)
            if target not in params:
                raise ValueError(f"{arch} in vLLM: unexpected weight {name!r} in the checkpoint")
            param = params[target]
            param.weight_loader(param, tensor, shard_id)
            shards.setdefault(target, set()).add(shard_id)
            break
        else:
            target = name
            if target not in params:
                raise ValueError(f"{arch} in vLLM: unexpected weight {name!r} in the checkpoint")
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    for target, ids in shards.items():
        want = next(v for k, v in expected.items() if k in target)
        if ids != want:
            raise ValueError(f"{arch} in vLLM: the checkpoint fills only part of {target!r}")
    loaded.update(name for name in params if ".attn" in name.rsplit(".self_attn.", 1)[-1])
    return loaded
