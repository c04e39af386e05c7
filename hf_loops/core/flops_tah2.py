"""FLOPs accounting for TaH2 and its baselines (the paper's App. A.4, Eqs. 13–23).

Convention: matmul FLOPs only, a multiply-add counts 2, a linear a→b costs 2ab per token; norms, softmax, top-k,
mixture and sampling are excluded. Where the query width n_h·d_head differs from d (Qwen3-0.6B, 4B) it replaces d in
the attention projections and in the per-key attention cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TaH2Shape:
    """The sizes the formulas need, read off a (TaH2 or Qwen3) config."""

    num_layers: int
    hidden: int
    query_width: int
    kv_width: int
    ffn: int
    vocab: int
    decider_topk: int
    updater_ffn: int
    decider_ffn: int

    @classmethod
    def from_config(cls, config) -> TaH2Shape:
        d = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden=d,
            query_width=config.num_attention_heads * head_dim,
            kv_width=kv_heads * head_dim,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            decider_topk=getattr(config, "decider_topk", None) or d,
            updater_ffn=getattr(config, "updater_intermediate_size", None) or d,
            decider_ffn=getattr(config, "decider_intermediate_size", None) or d,
        )


@dataclass(frozen=True)
class PerCallFlops:
    """Eq. 13: cost of one call of each component for one token."""

    backbone: float  # L[4 d (d_q + d_kv) + 6 d d_ff]
    head: float  # 2 d V
    attention_per_key: float  # 4 L d_q
    updater: float  # 4 d² + 6 d d_u
    decider: float  # 2 d (2d + k) + 6 d d_d + 2 d
    huginn_adapter: float  # 2 d²


def per_call_flops(config_or_shape) -> PerCallFlops:
    s = config_or_shape if isinstance(config_or_shape, TaH2Shape) else TaH2Shape.from_config(config_or_shape)
    d = s.hidden
    return PerCallFlops(
        backbone=s.num_layers * (4 * d * (s.query_width + s.kv_width) + 6 * d * s.ffn),
        head=2 * d * s.vocab,
        attention_per_key=4 * s.num_layers * s.query_width,
        updater=4 * d * d + 6 * d * s.updater_ffn,
        decider=2 * d * (2 * d + s.decider_topk) + 6 * d * s.decider_ffn + 2 * d,
        huginn_adapter=2 * d * d,
    )


def visible_keys_duo(prompt_streams: Sequence[int], previous_depths: Sequence[int], depth: int) -> int:
    """Eq. 15: keys visible to a decode token at depth m under duo attention:
    S_t(m) = Σ_{j≤P} min(r_j, m) + Σ_{u<t} min(m_u, m) + m."""
    return (
        sum(min(r, depth) for r in prompt_streams) + sum(min(mu, depth) for mu in previous_depths) + depth
    )


def _check_depths(depths: Sequence[int], max_iterations: int | None = None) -> None:
    for m in depths:
        if m < 1 or (max_iterations is not None and m > max_iterations):
            raise ValueError(f"per-token depths must lie in [1, {max_iterations or 'M'}], got {m}")


def decode_flops_tah2(config, depths: Sequence[int], prompt_streams: Sequence[int], max_iterations: int | None = None) -> float:
    """Eqs. 14/16: decoding FLOPs of TaH2 for decode tokens with executed depths `depths` (m_t, t = 1..N) after a
    prompt whose position j kept `prompt_streams[j]` streams."""
    M = max_iterations or getattr(config, "max_iterations", None) or max(depths, default=1)
    _check_depths(depths, M)
    c = per_call_flops(config)
    total = 0.0
    for t, m_t in enumerate(depths):
        keys = sum(visible_keys_duo(prompt_streams, depths[:t], m) for m in range(1, m_t + 1))
        total += (
            m_t * (c.backbone + c.head)
            + c.attention_per_key * keys
            + (m_t - 1) * c.updater
            + min(m_t, M - 1) * c.decider
        )
    return total


def decode_flops_standard(config, prompt_len: int, num_tokens: int) -> float:
    """Eq. 17: Σ_t [FLOPs_bb + FLOPs_head + 4Ld(P + t)]."""
    c = per_call_flops(config)
    return sum(c.backbone + c.head + c.attention_per_key * (prompt_len + t) for t in range(1, num_tokens + 1))


def decode_flops_fixed(config, prompt_len: int, num_tokens: int, max_iterations: int) -> float:
    """Eq. 18 (TaH2-fixed): every token runs M depths, the LM head and M−1 updater calls; causal mode keys."""
    c, M = per_call_flops(config), max_iterations
    return sum(
        M * (c.backbone + c.head)
        + (M - 1) * c.updater
        + c.attention_per_key * sum(prompt_len + t - 1 + m for m in range(1, M + 1))
        for t in range(1, num_tokens + 1)
    )


def decode_flops_ouro(config, prompt_len: int, num_tokens: int, max_iterations: int) -> float:
    """Eq. 19 (Ouro-style): M backbone passes, LM head once, same-iteration keys."""
    c, M = per_call_flops(config), max_iterations
    return sum(
        M * c.backbone + c.head + c.attention_per_key * M * (prompt_len + t) for t in range(1, num_tokens + 1)
    )


def decode_flops_huginn(config, prompt_len: int, num_tokens: int, max_iterations: int,
                        core_layers: int = 14, total_layers: int = 28) -> float:
    """Eq. 20 (Huginn-style): prelude + M × core + coda, LM head once, adapter 2d² per core iteration."""
    c, M = per_call_flops(config), max_iterations
    frac = (core_layers + core_layers * M) / total_layers
    return sum(
        frac * (c.backbone + c.attention_per_key * (prompt_len + t)) + c.head + M * c.huginn_adapter
        for t in range(1, num_tokens + 1)
    )


def training_flops_tah2(config, depths: Sequence[int], max_iterations: int | None = None, lookahead: bool = True) -> dict:
    """Eqs. 21–23 for one sequence whose tokens executed `depths` (no prompt term):
    forward, label (lookahead) and total ≈ 3·forward + label."""
    M = max_iterations or getattr(config, "max_iterations", None) or max(depths, default=1)
    _check_depths(depths, M)
    c = per_call_flops(config)
    T = len(depths)

    def keys(m: int, continued: bool) -> int:
        # Σ over tokens executing depth m of their visible keys S_t(m) (prompt term 0); with `continued`, every
        # token that executed depth m−1 is counted as if it had run depth m (the lookahead queries Ã).
        total = 0
        for t, m_t in enumerate(depths):
            runs = m_t >= m or (continued and m_t >= m - 1)
            if runs:
                total += visible_keys_duo([], depths[:t], m)
        return total

    forward = 0.0
    for m in range(1, M + 1):
        n_m = sum(1 for m_t in depths if m_t >= m)
        forward += n_m * (c.backbone + c.head) + c.attention_per_key * keys(m, False)
        if m >= 2:
            forward += n_m * c.updater
        if m <= M - 1:
            forward += n_m * c.decider
    label = 0.0
    if lookahead:
        for m in range(1, M):
            n_m = sum(1 for m_t in depths if m_t >= m)
            label += n_m * (c.updater + c.backbone + c.head) + c.attention_per_key * keys(m + 1, True)
    return {"forward": forward, "label": label, "total": 3 * forward + label, "tokens": T}


def decode_flops(config, prompt_streams, decode_depths, max_iterations=None) -> float:
    """Decode FLOPs of a TaH2-family model for the per-token depths `decode_depths` after a prompt whose positions kept
    `prompt_streams` streams, priced by the formula of the configuration's variant: TaH2-fixed (`decider="always"`,
    causal keys) by Eq. 18, Ouro-style (`decider="always"`, same-iteration keys, hidden updater) by Eq. 19, every other
    configuration by Eqs. 14–16 (at M = 1 these equal the Standard formula). The fixed-depth variants run every token
    to M: a depth below M there is a ValueError, not a cheaper price."""
    M = max_iterations or getattr(config, "max_iterations", None) or max(decode_depths, default=1)
    decider = getattr(config, "decider", "learned")
    attention = getattr(config, "iteration_attention", "duo")
    fixed_formula = None
    if decider == "always" and getattr(config, "core_adapter", None) is None and not getattr(config, "loop_span", None):
        if attention == "causal":
            fixed_formula = decode_flops_fixed
        elif attention == "same_iter" and getattr(config, "updater", None) == "hidden":
            fixed_formula = decode_flops_ouro
    if fixed_formula is None or M == 1:
        return decode_flops_tah2(config, decode_depths, prompt_streams, max_iterations)
    if any(m != M for m in decode_depths):
        raise ValueError(f"decode_depths: a decider='always' model runs every token to depth {M}, got depths "
                         f"{sorted(set(decode_depths))}")
    return fixed_formula(config, len(prompt_streams), len(decode_depths), M)
