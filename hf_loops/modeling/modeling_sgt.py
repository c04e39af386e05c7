"""SGT (Sparse Growing Transformer) on a Qwen3 backbone (docs/sgt.md).

In a looped layer l only the attention sub-layer is re-applied, K_l extra times, and only for the kept heads S_l:

    H0 = X + W_O · Attn(Norm_a(X))                                    # the normal Qwen3 attention sub-layer
    Hk = H(k-1) + Σ_{h∈S_l} g_h · W_O[:, h] · Attn_h(Norm_a(H(k-1)))   # k = 1..K_l, Q/K/V recomputed every loop
    Y  = HK + MLP(Norm_f(HK))

No new parameters: the loops reuse the layer's own `input_layernorm`, `q_proj`/`k_proj`/`v_proj` (with q/k RMSNorm and
RoPE at the same positions), `o_proj`. Layers keep Qwen3's state-dict names, so an empty plan is exactly Qwen3.

Two loop paths:
- sliced (inference and outside decay windows): index-selected rows of the shared projections, only the kept query
  heads and the key/value heads serving them (GQA) are computed and cached;
- masked (the reference form, `loop_masked=True`): all heads, gates applied to the head outputs before `o_proj`.
During a decay window the sliced path runs over every head whose gate is still > 0 and scales it by its gate.

Cache: slot (l, k) is the virtual layer index `num_hidden_layers + slot(l, k)` in `cache.layers` (slots ordered by
layer then loop); each holds only the kept heads' key/value groups. Causality makes caching each loop's K/V exact.

Attention: every pass calls transformers' attention interface with the call's own mask (built once per forward and
shared by all layers and loops): attn_implementation "sdpa", "eager", "flex_attention" or "flash_attention_2" (see
`SGTPreTrainedModel`).

Entropy probe (training only, while the growth callback asks for it): for each attention pass, the normalised entropy
of one query row per sequence (the last valid one, or a few sampled rows), computed from the same post-RoPE Q/K under
`no_grad` without ever materialising a T×T attention matrix.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils import can_return_tuple

from .configuration_sgt import SGTConfig
from .loop_utils import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    LayerCollector,
    LoopCacheView,
    LoopedContinuousBatchingMixin,
    QuantizedLoopCacheMixin,
    accepts_cache_kwarg,
    check_attn_implementation,
    create_causal_mask,
    create_sliding_window_causal_mask,
    ensure_cache_slots,
    flex_cpu_guard,
    is_paged_cache,
    paged_update,
    plain_attention_mask,
    positions_from_mask,
    slice_logits_to_keep,
)

# ----------------------------------------------------------------------------------------------------------------------
# Entropy statistic: how SGT ranks heads for looping
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def attention_row_entropy(query, key, attention_mask, rows, scaling: float) -> torch.Tensor:
    """Normalised attention entropy of selected query rows, per head, averaged over rows and batch.

    query: (B, Hq, T, d) post-RoPE; key: (B, Hq, S, d) post-RoPE, already expanded to the query heads; rows: (B, R)
    query indices in [0, T); attention_mask: None (causal, keys j <= i + S - T), a 4-D bool (True = keep) or a 4-D
    float additive mask. Entropy of row i is H(a_i) / log(n_i), n_i = number of visible keys (0 when n_i <= 1).
    Only the R selected rows' logits are formed: O(B·H·R·S·d), never a T×S matrix.
    """
    b, hq, t, d = query.shape
    s = key.shape[2]
    r = rows.shape[1]
    q = query.float().gather(2, rows[:, None, :, None].expand(b, hq, r, d))
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling  # (B, Hq, R, S)
    if attention_mask is None:
        allowed = torch.arange(s, device=q.device)[None, None, :] <= (rows[:, :, None] + (s - t))  # (B, R, S)
        allowed = allowed[:, None]
    else:
        m = attention_mask[..., -s:]
        m = m.expand(b, m.shape[1], t, s).gather(2, rows[:, None, :, None].expand(b, m.shape[1], r, s))
        allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    allowed = allowed.expand(b, hq, r, s)
    logits = logits.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    plogp = torch.where(allowed, logp.exp() * logp, torch.zeros((), device=q.device))
    entropy = -plogp.sum(-1)  # (B, Hq, R)
    n = allowed.sum(-1).float()
    norm = torch.where(n > 1, entropy / n.clamp_min(2).log(), torch.zeros_like(entropy))
    return norm.mean(dim=(0, 2))


def probe_rows_from_mask(attention_mask, batch: int, length: int, estimator: str, num_rows: int, device) -> torch.Tensor:
    """Query rows the entropy probe reads, per sequence: (B, R) indices.

    "last_row": the last valid position (T − 1 without right padding, as in the official code).
    "sampled_rows": that row plus `num_rows − 1` rows spread evenly (stratum midpoints, deterministic) over the valid
    positions >= 64 (all valid positions when the sequence is too short).
    """
    idx = torch.arange(length, device=device)
    if attention_mask is not None and attention_mask.dim() == 2:
        valid = attention_mask[:, -length:].bool()
        last = torch.where(valid, idx, torch.full_like(idx, -1)).amax(-1).clamp_min(0)
        first = torch.where(valid, idx, torch.full_like(idx, length)).amin(-1).clamp_max(length - 1)
    else:
        last = torch.full((batch,), length - 1, device=device, dtype=torch.long)
        first = torch.zeros((batch,), device=device, dtype=torch.long)
    if estimator == "last_row" or num_rows <= 1:
        return last[:, None]
    extra = num_rows - 1
    lo = torch.where(last - (first + 64) >= extra, first + 64, first)
    span = (last - lo).clamp_min(0).float()
    frac = (torch.arange(extra, device=device, dtype=torch.float) + 0.5) / extra
    picks = lo[:, None] + (frac[None, :] * span[:, None]).floor().long()
    return torch.cat([picks.clamp(max=length - 1), last[:, None]], dim=1)


# ----------------------------------------------------------------------------------------------------------------------
# Attention with loops
# ----------------------------------------------------------------------------------------------------------------------


class _HeadSubset:
    """The attention module as the attention interfaces see it in a sliced loop: `num_key_value_groups` is the number
    of kept query heads per kept kv head (K/V hold only κ(S)); every other attribute is the real module's."""

    def __init__(self, attn: Qwen3Attention, num_key_value_groups: int):
        self._attn = attn
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._attn, name)


def _selector(rows: list[int], total: int, device):
    """How to take the sorted `rows` out of `total`: None = all of them, a slice = one contiguous run (both views: no
    copy forward, no scatter backward), else an index tensor (`index_select`)."""
    if rows == list(range(total)):
        return None
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def _take(tensor, selector, dim: int):
    if selector is None:
        return tensor
    if isinstance(selector, slice):
        return tensor[selector] if dim == 0 else tensor[:, selector]
    return tensor.index_select(dim, selector)


class SGTAttention(Qwen3Attention):
    """`Qwen3Attention` (same parameters, same base computation) plus the looped passes and the entropy probe."""

    def _interface(self):
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)

    @accepts_cache_kwarg
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, probe=None, **kwargs):
        # Step for step Qwen3Attention.forward, so an empty plan reproduces Qwen3 bit for bit.
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        if probe is not None:
            probe(query_states, key_states, self.num_key_value_groups, None)
        attn_output, attn_weights = self._interface()(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def loop_masked(self, normed, position_embeddings, attention_mask, gate, cache=None, slot=None, probe=None,
                    **kwargs):
        """Reference loop: every head computed, head outputs scaled by `gate` (H,) before W_O."""
        input_shape = normed.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(normed).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(normed).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(normed).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None and is_paged_cache(cache):
            k, v = paged_update(cache, k, v, slot, kwargs)
        elif cache is not None:
            k, v = cache.update(k, v, slot)
        if probe is not None:
            probe(q, k, self.num_key_value_groups, None)
        out, _ = self._interface()(
            self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )  # (B, T, H, d)
        out = out * gate.to(out.dtype)[None, None, :, None]
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())

    def _slice_plan(self, heads: tuple[int, ...], device):
        """How a sliced loop over the sorted query heads `heads` reads the shared weights, cached per (heads, device):
        (q/o selector, kv selector, number of kv heads κ(S), kv groups or None, per-head kv index). With `groups` set,
        every kv head of κ(S) serves `groups` consecutive kept heads and the attention interface handles the GQA itself;
        otherwise K/V are expanded to one kv head per kept head with the per-head kv index."""
        key = (heads, str(device))
        cached = getattr(self, "_slice_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        d, groups = self.head_dim, self.num_key_value_groups
        kv_heads = sorted({h // groups for h in heads})
        q_sel = _selector([h * d + i for h in heads for i in range(d)], self.q_proj.out_features, device)
        kv_sel = _selector([g * d + i for g in kv_heads for i in range(d)], self.k_proj.out_features, device)
        kv_of_head = [kv_heads.index(h // groups) for h in heads]
        per_kv = len(heads) // len(kv_heads)
        uniform = kv_of_head == [i // per_kv for i in range(len(heads))]
        value = (q_sel, kv_sel, len(kv_heads), per_kv if uniform else None,
                 None if uniform else torch.tensor(kv_of_head, device=device))
        self._slice_cache = (key, value)
        return value

    def loop_sliced(self, normed, position_embeddings, attention_mask, heads, gate=None, cache=None, slot=None,
                    probe=None, **kwargs):
        """Sparse loop: only the query heads `heads` and their kv heads are computed (and cached), W_O column slice."""
        heads = tuple(heads)
        q_sel, kv_sel, n_kv, kv_groups, kv_of_head = self._slice_plan(heads, normed.device)
        b, t = normed.shape[:2]
        d = self.head_dim

        def proj(linear, sel):
            bias = _take(linear.bias, sel, 0) if linear.bias is not None else None
            return F.linear(normed, _take(linear.weight, sel, 0), bias)

        q = self.q_norm(proj(self.q_proj, q_sel).view(b, t, len(heads), d)).transpose(1, 2)
        k = self.k_norm(proj(self.k_proj, kv_sel).view(b, t, n_kv, d)).transpose(1, 2)
        v = proj(self.v_proj, kv_sel).view(b, t, n_kv, d).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None and is_paged_cache(cache):
            k, v = self._paged_loop_update(cache, k, v, slot, kwargs)
        elif cache is not None:
            k, v = cache.update(k, v, slot)
        if kv_groups is None:  # kept heads spread unevenly over κ(S): one kv head per kept query head
            k, v, kv_groups = k.index_select(1, kv_of_head), v.index_select(1, kv_of_head), 1
        if probe is not None:
            probe(q, k, kv_groups, heads)
        out, _ = self._interface()(
            _HeadSubset(self, kv_groups), q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )  # (B, T, h, d)
        if gate is not None:
            out = out * gate.to(out.dtype)[None, None, :, None]
        return F.linear(out.reshape(b, t, len(heads) * d), _take(self.o_proj.weight, q_sel, 1), self.o_proj.bias)


    def _paged_loop_update(self, cache, k, v, slot, kwargs):
        """A sliced loop's K/V (κ(S) kv heads) in transformers' paged cache, whose pages hold every kv head: the
        kept heads fill the first κ(S) head rows, zeros the rest, and the read-back returns the first κ(S) rows."""
        n_kv, missing = k.shape[1], self.config.num_key_value_heads - k.shape[1]
        if missing:
            k, v = (F.pad(t, (0, 0, 0, 0, 0, missing)) for t in (k, v))
        k, v = paged_update(cache, k, v, slot, kwargs)
        return (k[:, :n_kv], v[:, :n_kv]) if missing else (k, v)


class SGTDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 decoder layer whose attention sub-layer can be re-applied `loop_depth` times for `loop_heads`.

    The loop structure is plain Python state (static for `torch.compile`), set from the config's `loop_plan` at build
    time or by the growth callback through `SGTModel.set_loop`. `head_gate` (H,) holds the gates g_h.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = SGTAttention(config=config, layer_idx=layer_idx)
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.loop_depth = 0
        self.loop_heads: list[int] = []  # heads computed by the sliced path (gate > 0)
        self.loop_gated = False  # some gate of loop_heads is in (0, 1): scale head outputs by their gates
        self.loop_masked = False  # use the reference (all heads, masked) path instead of the sliced one
        self._gate_list = [1.0] * self.num_heads
        self.register_buffer("head_gate", torch.ones(self.num_heads), persistent=False)
        self.collect_entropy = False
        self.entropy_sum: torch.Tensor | None = None  # (rows = loop index 0..K, H)
        self.entropy_count: torch.Tensor | None = None

    # --- structure -----------------------------------------------------------------------------------------------
    def set_loop(self, heads, depth: int, gates=None) -> None:
        """Loop `heads` `depth` extra times; `gates` (H floats in [0, 1]) default to 1 on `heads`, 0 elsewhere."""
        if gates is None:
            gates = [1.0 if h in set(heads) else 0.0 for h in range(self.num_heads)]
        gates = [float(g) for g in gates]
        if len(gates) != self.num_heads or any(not 0.0 <= g <= 1.0 for g in gates):
            raise ValueError(f"gates must be {self.num_heads} floats in [0, 1], got {gates}")
        if depth < 0 or (depth > 0 and not any(g > 0.0 for g in gates)):
            raise ValueError(f"layer {self.layer_idx}: depth must be >= 0 and a looped layer needs a head with gate > 0")
        self.loop_depth = int(depth)
        self.loop_heads = [h for h in range(self.num_heads) if gates[h] > 0.0]
        self.loop_gated = any(0.0 < gates[h] < 1.0 for h in self.loop_heads)
        self._gate_list = gates
        with torch.no_grad():
            self.head_gate.copy_(torch.tensor(gates, dtype=self.head_gate.dtype))

    # --- entropy statistic -----------------------------------------------------------------------------------------
    def _probe(self, loop_index: int, rows, attention_mask):
        """A callback for SGTAttention: records per-head row entropies of this pass under `loop_index`."""

        def record(query, key, groups, heads):
            if groups > 1:
                key = key.repeat_interleave(groups, dim=1)
            e = attention_row_entropy(query, key, attention_mask, rows, self.self_attn.scaling)
            n_rows = max(loop_index + 1, self.loop_depth + 1)
            if self.entropy_sum is None or self.entropy_sum.shape[0] < n_rows:
                new_sum = torch.zeros(n_rows, self.num_heads, device=e.device)
                new_count = torch.zeros(n_rows, self.num_heads, device=e.device)
                if self.entropy_sum is not None:
                    new_sum[: self.entropy_sum.shape[0]] = self.entropy_sum
                    new_count[: self.entropy_count.shape[0]] = self.entropy_count
                self.entropy_sum, self.entropy_count = new_sum, new_count
            idx = slice(None) if heads is None else torch.tensor(heads, device=e.device)
            self.entropy_sum[loop_index, idx] += e
            self.entropy_count[loop_index, idx] += 1

        return record

    def pop_entropy(self):
        out = (self.entropy_sum, self.entropy_count)
        self.entropy_sum = self.entropy_count = None
        return out

    # --- forward ---------------------------------------------------------------------------------------------------
    @accepts_cache_kwarg
    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, loop_slots=None, probe_rows=None, probe_mask=None, **kwargs):
        """`probe_mask`: the attention mask as a tensor (or None = causal) for the entropy probe, when the attention
        backend's own mask is not one (a flex `BlockMask`, a flash 2-D padding mask); defaults to `attention_mask`."""
        probing = self.collect_entropy and probe_rows is not None
        probe_mask = attention_mask if probe_mask is None else probe_mask
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            probe=self._probe(0, probe_rows, probe_mask) if probing else None,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        for k in range(1, self.loop_depth + 1):
            # Each loop re-reads the stream it updated; Q, K, V from the same input norm, same positions.
            normed = self.input_layernorm(hidden_states)
            slot = loop_slots[k - 1] if cache is not None else None
            probe = self._probe(k, probe_rows, probe_mask) if probing else None
            # position_ids reach the attention interface as in the first pass (flash-attention's packed sequences).
            if self.loop_masked:
                delta = self.self_attn.loop_masked(normed, position_embeddings, attention_mask, self.head_gate,
                                                   cache=cache, slot=slot, probe=probe, position_ids=position_ids,
                                                   **kwargs)
            else:
                gate = self.head_gate[self.loop_heads] if self.loop_gated else None
                delta = self.self_attn.loop_sliced(normed, position_embeddings, attention_mask, self.loop_heads,
                                                   gate=gate, cache=cache, slot=slot, probe=probe,
                                                   position_ids=position_ids, **kwargs)
            hidden_states = hidden_states + delta

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


# Attention backends SGT runs on. Every attention call of SGT (first pass, head loops, Block Loop repeats, with or
# without cache) uses the plain causal mask of the call (+ padding, packed documents, sliding window), so any backend
# that takes transformers' standard masks works; the loop cache slots always hold as many positions as the base cache.
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "paged|eager")
# Backends whose mask is a tensor (or None = causal) that the entropy probe can read directly.
_TENSOR_MASK_IMPLEMENTATIONS = ("eager", "sdpa")


def _check_attn(impl) -> None:
    check_attn_implementation(impl, "SGT", ATTENTION_IMPLEMENTATIONS, needs_mask_function=True,
                              reason="'paged|eager' is what continuous batching switches eager to; other flash "
                                     "and paged kernels are not verified")


class _ConfigWithAttention:
    """A read-only view of a config with another `_attn_implementation` (to build a mask of another backend's kind)."""

    def __init__(self, config, attn_implementation: str):
        self._config = config
        self._attn_implementation = attn_implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


class SGTPreTrainedModel(PreTrainedModel):
    """Base class of the SGT models.

    Attention backends (`attn_implementation`): "sdpa" (default), "eager", "flex_attention" (a `BlockMask` built once
    per forward call and shared by every layer, loop and cache slot; CPU and GPU) and "flash_attention_2": every SGT
    attention call, loops included, uses the call's plain causal + padding mask (position_ids for packed sequences),
    which is exactly what flash-attention takes. flash_attention_2 needs the `flash_attn` package and has not been run
    here (no GPU); flash_attention_3/4 and paged kernels other than "paged|eager" (what continuous batching switches
    eager to) raise a `ValueError` at load / `set_attn_implementation` (see `_check_attn`). Under transformers'
    continuous batching every loop writes its own paged slot (`SGTForCausalLM.paged_cache_layer_types`). The entropy probe of the growth phase builds its own tensor mask when the
    backend's mask is not one.
    """

    config: SGTConfig
    config_class = SGTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SGTDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        _check_attn(attn_implementation)
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check=is_init_check, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SGTDecoderLayer):
            init.copy_(module.head_gate, torch.tensor(module._gate_list, dtype=module.head_gate.dtype))


class SGTModel(SGTPreTrainedModel):
    def __init__(self, config: SGTConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([SGTDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        for entry in config.loop_plan or []:
            self.layers[entry["layer"]].set_loop(entry["heads"], entry["depth"])
        self.post_init()

    # --- structure API used by the growth callback ----------------------------------------------------------------
    def set_loop(self, layer: int, heads, depth: int, gates=None) -> None:
        if self.config.loop_mode != "heads":
            raise ValueError("set_loop needs loop_mode='heads' (the Block Loop baseline is static)")
        self.layers[layer].set_loop(heads, depth, gates)

    def loop_structure(self) -> list[dict]:
        """The current loops: heads with a non-zero gate and depth, per looped layer (the plan once gates are 0/1)."""
        return [{"layer": i, "heads": list(l.loop_heads), "depth": l.loop_depth}
                for i, l in enumerate(self.layers) if l.loop_depth > 0]

    def set_entropy_statistics(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.collect_entropy = bool(enabled)
            if not enabled:
                layer.pop_entropy()

    def pop_entropy_statistics(self, num_loops: int):
        """Per-micro-batch sums and counts since the last pop: two (L, num_loops + 1, H) float tensors."""
        device = self.embed_tokens.weight.device
        shape = (len(self.layers), num_loops + 1, self.config.num_attention_heads)
        sums, counts = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        for i, layer in enumerate(self.layers):
            s, c = layer.pop_entropy()
            if s is not None:
                r = min(s.shape[0], num_loops + 1)
                sums[i, :r], counts[i, :r] = s[:r].to(device), c[:r].to(device)
        return sums, counts

    def _loop_slots(self) -> tuple[list[list[int]], int]:
        """Cache index of each (layer, loop): num_hidden_layers + running slot number, ordered by (layer, loop)."""
        n = self.config.num_hidden_layers
        slots = []
        for i, layer in enumerate(self.layers):
            reps = self._block_repeats(i) if self.config.loop_mode == "block" else layer.loop_depth
            slots.append(list(range(n, n + reps)))
            n += reps
        return slots, n

    def _block_repeats(self, i: int) -> int:
        return self.config.block_loop_depth if i in self.config.block_loop_layers else 0

    @can_return_tuple
    @accepts_cache_kwarg
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, output_attentions=None,
                **kwargs) -> BaseModelOutputWithPast:
        """`output_hidden_states`: each layer's input and the final-normed output (Qwen3's convention; a looped
        layer's loops happen inside it). `output_attentions` (eager only): each layer's first-pass weights."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        paged = is_paged_cache(cache)  # continuous batching: its paged cache, with use_cache=False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache and not paged:
            cache = None
        slots, num_slots = self._loop_slots()
        if cache is not None and not paged:
            ensure_cache_slots(cache, num_slots)

        length = inputs_embeds.shape[1]
        mask2d = plain_attention_mask(attention_mask)
        mask2d = mask2d if isinstance(mask2d, torch.Tensor) and mask2d.dim() == 2 else None
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = positions_from_mask(mask2d, past, length, inputs_embeds.device)

        collect = LayerCollector.requested(self.config, output_hidden_states, output_attentions)
        with flex_cpu_guard(self.config, inputs_embeds.device):  # CPU flex: static-shape kernels (see loop_utils)
            mask_mapping, probe_rows, probe_masks = self._call_masks(attention_mask, mask2d, inputs_embeds, cache,
                                                                     position_ids)
            hidden_states = inputs_embeds
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
            for i, layer in enumerate(self.layers):
                call = functools.partial(self._layer_call, layer, i, mask_mapping=mask_mapping, slots=slots,
                                         cache=cache, position_ids=position_ids, use_cache=use_cache,
                                         position_embeddings=position_embeddings, probe_rows=probe_rows,
                                         probe_masks=probe_masks, **kwargs)
                if collect is not None:
                    collect.hidden.append(hidden_states)
                    if collect.attentions is not None:
                        with collect.attention_weights_of(layer, first_call_only=True):
                            hidden_states = call(hidden_states)
                        continue
                hidden_states = call(hidden_states)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, cache=cache if use_cache else None,
            hidden_states=collect.hidden_states(hidden_states) if collect is not None and collect.want_hidden else None,
            attentions=tuple(collect.attentions) if collect is not None and collect.attentions is not None else None,
        )

    def _call_masks(self, attention_mask, mask2d, inputs_embeds, cache, position_ids):
        """The masks of one forward call: (per-layer-type mapping, entropy-probe rows or None, per-layer-type probe
        masks or None). The probe gets a tensor mask of its own when the backend's is not one (flex, flash)."""
        probe_rows = probe_masks = None
        if self.training and any(layer.collect_entropy for layer in self.layers):
            batch, length = inputs_embeds.shape[:2]
            probe_rows = probe_rows_from_mask(mask2d, batch, length, self.config.entropy_estimator,
                                              self.config.entropy_sample_rows, inputs_embeds.device)
            if self.config._attn_implementation not in _TENSOR_MASK_IMPLEMENTATIONS:
                plain = plain_attention_mask(attention_mask)  # a 2-D or 4-D tensor; a pre-built BlockMask → causal
                probe_masks = self._mask_mapping(_ConfigWithAttention(self.config, "sdpa"),
                                                 plain if isinstance(plain, torch.Tensor) else None, inputs_embeds,
                                                 cache, position_ids)
        if isinstance(attention_mask, dict):
            mask_mapping = attention_mask
        else:
            mask_mapping = self._mask_mapping(self.config, attention_mask, inputs_embeds, cache, position_ids)
        return mask_mapping, probe_rows, probe_masks

    def _mask_mapping(self, config, attention_mask, inputs_embeds, cache, position_ids) -> dict:
        """The attention mask of each layer type, in `config._attn_implementation`'s form (4-D tensor, None = causal,
        flex `BlockMask`, flash 2-D padding mask). Built once per forward call and shared by every layer, head loop,
        Block Loop repeat and cache slot: each slot holds as many positions as the base cache."""
        kwargs = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "cache": cache,
                  "position_ids": position_ids}
        mapping = {"full_attention": create_causal_mask(**kwargs)}
        if self.has_sliding_layers:
            mapping["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return mapping

    def _layer_call(self, layer, i, hidden_states, *, mask_mapping, slots, cache, position_ids, use_cache,
                    position_embeddings, probe_rows=None, probe_masks=None, **kwargs):
        """One decoder layer with its loops (head loops inside the layer, or the Block Loop repeats)."""
        layer_type = self.config.layer_types[i]
        common = dict(attention_mask=mask_mapping[layer_type], position_ids=position_ids,
                      use_cache=use_cache, position_embeddings=position_embeddings)
        if self.config.loop_mode == "block":
            # Block Loop baseline: the whole block applied 1 + block_loop_depth times, one cache slot per repeat.
            hidden_states = layer(hidden_states, cache=cache, **common, **kwargs)
            for slot in slots[i]:
                view = LoopCacheView(cache, slot - i) if cache is not None else None
                hidden_states = layer(hidden_states, cache=view, **common, **kwargs)
        else:
            probe_mask = probe_masks[layer_type] if probe_masks is not None else None
            hidden_states = layer(hidden_states, cache=cache, loop_slots=slots[i], probe_rows=probe_rows,
                                  probe_mask=probe_mask, **common, **kwargs)
        return hidden_states


class SGTForCausalLM(QuantizedLoopCacheMixin, LoopedContinuousBatchingMixin, SGTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor / pipeline parallelism as Qwen3ForCausalLM: the backbone's plan comes from the config (Qwen3's
    # `base_model_tp_plan`), the LM head is column-sharded with gathered logits; the loop's own modules are replicated.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: SGTConfig):
        super().__init__(config)
        self.model = SGTModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def paged_cache_layer_types(self) -> list[str]:
        """Continuous batching: the layer type of every cache slot (the layers, then one slot per loop or Block Loop
        repeat, as `SGTModel._loop_slots` numbers them), for transformers' paged cache."""
        slots, _ = self.model._loop_slots()
        types = list(self.config.layer_types)
        return types + [types[i] for i, layer_slots in enumerate(slots) for _ in layer_slots]

    @accepts_cache_kwarg
    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0,
                output_hidden_states=None, output_attentions=None, **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, output_attentions=output_attentions, return_dict=True,
                             **kwargs)
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


__all__ = ["SGTAttention", "SGTDecoderLayer", "SGTForCausalLM", "SGTModel", "SGTPreTrainedModel",
           "attention_row_entropy"]
