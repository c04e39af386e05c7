"""FLOPs accounting for SGT and the Block Loop baseline (docs/sgt.md).

Per token, forward pass, OLMo convention: a matmul of an m×n weight costs 2·m·n; attention over T keys costs 4·T·d per
layer (scores + weighted sum). Training ≈ 3 × forward for numerator and denominator, so every overhead ratio below is
the same for training and inference.

Released OLMo-300M config (d = 1024, H = 16, d_h = 64, L = 16, N = 371M, T = 4096): one layer × 2 heads × K = 1 →
0.31 %; 3 layers → 0.93 %; 3 layers × K = 3 → 2.8 %; one block loop → 4.98 %; three → 14.9 %.
"""

from __future__ import annotations

from collections.abc import Iterable


def loop_flops_per_token(d_model: int, head_dim: int, num_heads: int, seq_len: int,
                         num_kv_heads: int | None = None) -> float:
    """Forward FLOPs of ONE attention loop over `num_heads` kept query heads (sliced computation).

    MHA (num_kv_heads None or == num_heads): 8·h·d_h·d + 4·T·h·d_h.
    GQA: 2·d·h·d_h (Q) + 4·d·|κ(S)|·d_h (K, V) + 2·h·d_h·d (W_O) + 4·T·h·d_h (scores + weighted sum).
    """
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return 2 * d_model * num_heads * head_dim + 4 * d_model * kv * head_dim + 2 * num_heads * head_dim * d_model \
        + 4 * seq_len * num_heads * head_dim


def model_flops_per_token(num_params: float, num_layers: int, d_model: int, seq_len: int) -> float:
    """Forward FLOPs per token of the vanilla model: 2·N + L·4·T·d."""
    return 2 * num_params + num_layers * 4 * seq_len * d_model


def block_flops_per_token(d_model: int, seq_len: int, layer_params: float | None = None,
                          intermediate_size: int | None = None) -> float:
    """Forward FLOPs of one extra application of a whole block: 2·P_layer + 4·T·d.

    P_layer defaults to 4d² (attention) + 3·d·I (SwiGLU), with I = 4d → 16d².
    """
    if layer_params is None:
        inter = 4 * d_model if intermediate_size is None else intermediate_size
        layer_params = 4 * d_model * d_model + 3 * d_model * inter
    return 2 * layer_params + 4 * seq_len * d_model


def sgt_overhead(loops: Iterable[tuple[int, int]], *, d_model: int, head_dim: int, seq_len: int, num_params: float,
                 num_layers: int, num_kv_heads: Iterable[int] | None = None) -> float:
    """Σ_l K_l · F_loop(h_l) / F_model for `loops` = [(heads h_l, depth K_l), ...] (a fraction, not %)."""
    loops = list(loops)
    kvs = [None] * len(loops) if num_kv_heads is None else list(num_kv_heads)
    extra = sum(depth * loop_flops_per_token(d_model, head_dim, heads, seq_len, kv)
                for (heads, depth), kv in zip(loops, kvs, strict=True))
    return extra / model_flops_per_token(num_params, num_layers, d_model, seq_len)


def block_loop_overhead(num_blocks: int, depth: int = 1, *, d_model: int, seq_len: int, num_params: float,
                        num_layers: int, layer_params: float | None = None,
                        intermediate_size: int | None = None) -> float:
    """Block Loop baseline: num_blocks · depth · F_block / F_model."""
    extra = num_blocks * depth * block_flops_per_token(d_model, seq_len, layer_params, intermediate_size)
    return extra / model_flops_per_token(num_params, num_layers, d_model, seq_len)


def parameters_of_config(config) -> int:
    """Parameters of a Qwen3-style config (embeddings, attention, SwiGLU MLP, norms, untied head if any)."""
    d, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    attn = d * q + 2 * d * kv + q * d + 2 * head_dim
    if getattr(config, "attention_bias", False):
        attn += q + 2 * kv + d
    per_layer = attn + 3 * d * inter + 2 * d
    emb = config.vocab_size * d
    head = 0 if getattr(config, "tie_word_embeddings", False) else emb
    return emb + layers * per_layer + d + head


def _kv_groups(config, heads) -> int:
    groups = config.num_attention_heads // config.num_key_value_heads
    return len({h // groups for h in heads})


def plan_overhead(config, seq_len: int, plan=None, num_params: float | None = None) -> float:
    """Forward (= training) FLOPs overhead of an SGT config's loop plan (or Block Loop setting) vs the vanilla model.

    `plan`: a list of `{"layer", "heads", "depth"}` (default: `config.loop_plan`); GQA-aware (κ(S) kv heads).
    """
    d = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    n = parameters_of_config(config) if num_params is None else num_params
    if getattr(config, "loop_mode", "heads") == "block":
        return block_loop_overhead(len(config.block_loop_layers), config.block_loop_depth, d_model=d,
                                   seq_len=seq_len, num_params=n, num_layers=config.num_hidden_layers,
                                   intermediate_size=config.intermediate_size)
    plan = config.loop_plan if plan is None else plan
    plan = [e for e in (plan or []) if e["depth"] > 0]
    return sgt_overhead([(len(e["heads"]), e["depth"]) for e in plan], d_model=d, head_dim=head_dim,
                        seq_len=seq_len, num_params=n, num_layers=config.num_hidden_layers,
                        num_kv_heads=[_kv_groups(config, e["heads"]) for e in plan])


def training_overhead(per_step_overheads: Iterable[float]) -> float:
    """Training FLOPs overhead of a whole run vs vanilla: the mean of the per-step overheads (each step has the same
    vanilla cost). During a decay window a looped layer computes every head with a non-zero gate, so its per-step
    overhead is that of a full-width loop; `SGTGrowthCallback` logs both values."""
    values = list(per_step_overheads)
    return sum(values) / len(values) if values else 0.0


__all__ = ["block_flops_per_token", "block_loop_overhead", "parameters_of_config", "loop_flops_per_token",
           "model_flops_per_token", "plan_overhead", "sgt_overhead", "training_overhead"]


def decode_flops(config, prompt_streams, decode_depths, max_iterations=None) -> float:
    """Decode FLOPs of SGT for `len(decode_depths)` tokens after a prompt of `len(prompt_streams)`: the Standard
    formula times the loop plan's overhead at the mean context length (no per-token depth)."""
    from .flops_tah2 import decode_flops_standard

    P, N = len(prompt_streams), len(decode_depths)
    if N == 0:
        return 0.0
    base = decode_flops_standard(config, P, N)
    return base * (1.0 + plan_overhead(config, seq_len=P + (N + 1) // 2))
