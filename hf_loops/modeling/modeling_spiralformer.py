"""SpiralFormer: a middle-cycle looped transformer whose loop iterations run at different resolutions
(docs/spiralformer.md).

    h(0)   = f_pre(x)                                   (MeSH: transitional write/read of f_pre(x))
    h(t+1) = U(ũ(t), h(t))     t = 0..T−1               one loop step at chunk size g_t (coarse → fine)
    out    = lm_head(norm(f_post(h(T))))

One loop step at chunk size g (ω = chunk offset, s = causal shift, λ = √g):
    chunk map   π(i) = ⌊(i+ω)/g⌋, ρ(i) = (i+ω) mod g; chunk 0 is partial (ω virtual members)
    down        z_j = Σ_{i∈chunk j} α_{j,i} h_i            α = within-chunk softmax of A(h) (or 1/g)
    core        ẑ = f_loop(z)                              the shared layers, causal over the closed chunks
    up          u_i = λ β_{π(i),ρ(i)} ẑ_{π(i)}             β = softmax(B(ẑ_j)) over the g readers (or 1/g)
    shift       ũ_i = u_{i−s}                              s = g−1 is the smallest causal shift
    topology    Anchor: h = h(0) + ũ;  MeSH: routers(h) → write ũ into B slots → read

Every token with s = g−1 reads the most recently *closed* chunk j* = ⌊(i+ω+1)/g⌋−1 at allocation index
k* = (i+ω+1) mod g, so a token never sees a chunk that contains a later token (causality), and incremental
decoding only needs, per iteration, the core K/V of the closed latents, an online-softmax accumulator for the open
chunk and the last closed latent.

Cache layout (`cache.layers`): pre layer l → l; core (t, l) → N_pre + t·N_loop + l; post layer l → N_pre + T·N_loop + l
(when N_pre = 0 the post slots come first so slot 0 always counts tokens); then one decode-state slot per iteration
(`SpiralStateLayer`: [m, Z, S, v_last, β_last] in fp32, shape (b, 1, 1, X)). Pre/post slots are plain `DynamicLayer`s;
core slots are ragged `SpiralCoreLayer`s: one K/V tensor per batch row holding exactly that row's closed latents, so a
left-padded or non-triggering row costs no placeholder columns. All of them move with beam-search reorder, batch repeat
and batch select. Decoding runs the core only on the rows whose chunk closes at the new token (one host sync per step,
to learn which rows those are); left-padded batches are exact (chunk maps come from per-row positions).

Attention backends: every attention call goes through transformers' attention interface with a mask built once per
forward call per shape (`_mask`): a float additive mask for "eager" and "sdpa", a `BlockMask` for "flex_attention".

This file ships as Hub remote code: it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
from transformers.generation import GenerationMixin
from transformers.modeling_utils import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.utils import can_return_tuple

from .configuration_spiralformer import SpiralFormerConfig
from .kv_quant import QuantizedLoopLayer, kv_layer_bytes
from .loop_utils import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    LayerCollector,
    LoopCacheView,
    LoopedContinuousBatchingMixin,
    QuantizedLoopCacheMixin,
    Qwen3DecoderLayer,
    accepts_cache_kwarg,
    additive_mask,
    block_mask,
    check_attn_implementation,
    ensure_cache_slots,
    plain_attention_mask,
    positions_from_mask,
    slice_logits_to_keep,
)

_NEG = -1.0e30  # finite "−∞" for scores and the empty online-softmax max (keeps exp() exact zeros and no NaNs)


# ----------------------------------------------------------------------------------------------------------------------
# Index algebra: token i ↔ chunk π(i), slot ρ(i), latent positions
# ----------------------------------------------------------------------------------------------------------------------


def chunk_offset(config, g: int) -> int:
    """ω_t: half a chunk (staggers the triggers of a power-of-two schedule) or zero."""
    return g // 2 if config.chunk_offset == "half" else 0


def shift_of(config, g: int) -> int:
    """s_t: g − 1 (overlap; the closing token reads its own chunk) or g (no overlap; pipelinable)."""
    return g - 1 if config.shift == "overlap" else g


def reader_index(config, g: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form read map of ũ_i = u_{i−s}: chunk j, allocation index k, and whether token `pos` gets an update.

    overlap: j* = ⌊(i+ω+1)/g⌋ − 1, k* = (i+ω+1) mod g; no overlap: j = π(i) − 1, k = ρ(i). The literal frame gives no
    update to the first s tokens (u is defined on real tokens only); the padded frame only requires j ≥ 0.
    """
    omega, s = chunk_offset(config, g), shift_of(config, g)
    q = pos + omega + (1 if config.shift == "overlap" else 0)
    j = torch.div(q, g, rounding_mode="floor") - 1
    k = q % g
    readable = j >= 0
    if config.shift_frame == "literal":
        readable = readable & (pos >= s)
    return j, k, readable


def latent_position_ids(config, g: int, j: torch.Tensor) -> torch.Tensor:
    """RoPE position of latent j (the position of its chunk's last member)."""
    if config.latent_positions == "chunk_index":
        return j
    if config.latent_positions == "last_token":
        return (j + 1) * g - chunk_offset(config, g) - 1
    return j * g


class _SlotLayout:
    """Virtual cache indices and the `LoopCacheView` offsets of each physical layer group."""

    def __init__(self, config):
        n_pre, n_loop, n_post, T = (
            config.num_pre_layers,
            config.num_loop_layers,
            config.num_post_layers,
            len(config.chunk_sizes),
        )
        if n_pre >= 1:
            self.pre, self.core, self.post = 0, n_pre, n_pre + T * n_loop
        else:  # slot 0 must count tokens (generate reads cache.get_seq_length())
            self.pre, self.post, self.core = 0, 0, n_post
        self.n_pre, self.n_loop, self.n_post, self.T = n_pre, n_loop, n_post, T
        self.bookkeeping = n_pre + T * n_loop + n_post
        self.inputs = self.bookkeeping + T  # the token stream's inputs, kept so that a crop can be rebuilt exactly
        self.total = self.bookkeeping + T + 1

    def pre_offset(self) -> int:
        return self.pre  # physical index l → slot l

    def core_offset(self, t: int) -> int:
        return self.core + t * self.n_loop - self.n_pre  # physical n_pre + l → core + t·n_loop + l

    def post_offset(self) -> int:
        return self.post - self.n_pre - self.n_loop  # physical n_pre + n_loop + l → post + l

    def core_slot(self, t: int, l: int) -> int:
        return self.core + t * self.n_loop + l

    def core_slots(self) -> list[int]:
        return [self.core_slot(t, l) for t in range(self.T) for l in range(self.n_loop)]

    def token_slots(self) -> list[int]:
        core = set(self.core_slots())
        return [i for i in range(self.bookkeeping) if i not in core]

    def state_slot(self, t: int) -> int:
        return self.bookkeeping + t


# ----------------------------------------------------------------------------------------------------------------------
# Cache slots of the loops: ragged core K/V and the per-iteration decode state
# ----------------------------------------------------------------------------------------------------------------------


class SpiralCoreLayer(CacheLayerMixin):
    """Core K/V of one (iteration, core layer) in a ragged layout: per batch row one (n_kv, C_r, d_head) key and value
    tensor holding exactly the C_r latents that row has closed (None while C_r = 0). Rows never carry placeholder
    columns — neither for left padding nor for steps at which only other rows closed a chunk.

    Written only through `_CoreCacheView`: `write_prefill` after a full forward, `append_rows` for the triggering rows
    of a decode step. Row tensors are never modified in place, so beam reorder / batch repeat / batch select just
    permute the per-row lists (rows may share tensors until they diverge)."""

    is_sliding = False
    is_croppable = True  # a crop marks the decode state stale; the model then rebuilds every loop slot exactly

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.row_keys: list = []
        self.row_values: list = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def start(self, batch_size: int) -> None:
        """Empty rows for a new prefill."""
        self.row_keys, self.row_values = [None] * batch_size, [None] * batch_size
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("SpiralCoreLayer is written through SpiralFormer's core cache view (append_rows)")

    def write_prefill(self, key_states, value_states, keep: list[int]):
        """Prefill: row r keeps its first keep[r] latents (own copies, so no row pins the padded batch tensor)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)

        def own(x, r):
            return x[r, :, : keep[r]].clone(memory_format=torch.contiguous_format) if keep[r] > 0 else None

        self.row_keys = [own(key_states, r) for r in range(len(keep))]
        self.row_values = [own(value_states, r) for r in range(len(keep))]
        return key_states, value_states

    def append_rows(self, key_states, value_states, rows: list[int]):
        """Decode: key_states (k, n_kv, 1, d) are the new latents of batch rows `rows`. Appends them and returns the
        keys/values to attend over, (k, n_kv, W, d) with W = max C_r + 1: row i holds its C_r old latents, then the
        new one at column C_r, then zeros (masked by the caller: column c is visible iff c ≤ C_r)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        outs = []
        for store, new in ((self.row_keys, key_states), (self.row_values, value_states)):
            grown = []
            for i, r in enumerate(rows):
                store[r] = new[i] if store[r] is None else torch.cat([store[r], new[i]], dim=-2)
                grown.append(store[r])
            width = max(x.shape[-2] for x in grown)
            outs.append(torch.stack([F.pad(x, (0, 0, 0, width - x.shape[-2])) for x in grown]))
        return outs[0], outs[1]

    def row_lengths(self) -> list[int]:
        return [0 if x is None else x.shape[-2] for x in self.row_keys]

    def trim(self, lengths: list[int]) -> None:
        """Row r keeps its first lengths[r] latents (a crop back into the latest decoding call)."""
        for store in (self.row_keys, self.row_values):
            for r, n in enumerate(lengths):
                if store[r] is not None and store[r].shape[-2] > n:
                    store[r] = store[r][..., :n, :] if n > 0 else None

    def nbytes(self) -> int:
        """Bytes of K and V actually held (tensors shared by several rows after a beam reorder count once)."""
        seen, total = set(), 0
        for x in self.row_keys + self.row_values:
            if x is not None and id(x) not in seen:
                seen.add(id(x))
                total += x.numel() * x.element_size()
        return total

    def _take(self, rows) -> None:
        self.row_keys = [self.row_keys[r] for r in rows]
        self.row_values = [self.row_values[r] for r in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._take(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._take([r for r in range(len(self.row_keys)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._take(torch.arange(len(self.row_keys))[torch.as_tensor(indices).cpu()].reshape(-1).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")  # as DynamicLayer

    def reset(self) -> None:
        self.row_keys, self.row_values = [], []
        self.is_initialized = False

    def offload(self):
        self._move("cpu")

    def prefetch(self):
        if self.is_initialized:
            self._move(self.device)

    def _move(self, device) -> None:
        self.row_keys = [None if x is None else x.to(device, non_blocking=True) for x in self.row_keys]
        self.row_values = [None if x is None else x.to(device, non_blocking=True) for x in self.row_values]

    def get_seq_length(self) -> int:
        return max(self.row_lengths(), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class QuantizedSpiralCoreLayer(SpiralCoreLayer):
    """`SpiralCoreLayer` of a quantized loop cache (kv_quant.py): each row's latents live in a one-row
    `QuantizedLoopLayer` (per-token int8 / int4 codes, fp window of its latest latents). Rows that a beam reorder made
    share a store get their own (sharing its tensors, which are never written in place) before they diverge."""

    def __init__(self, config=None, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.rows: list = []

    def _new_row(self, keys, values):
        layer = QuantizedLoopLayer(self.config)
        layer.update(keys, values)
        return layer

    def start(self, batch_size: int) -> None:
        self.rows = [None] * batch_size
        self.is_initialized = True

    def write_prefill(self, key_states, value_states, keep: list[int]):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.rows = [self._new_row(key_states[r:r + 1, :, :n], value_states[r:r + 1, :, :n]) if n > 0 else None
                     for r, n in enumerate(keep)]
        return key_states, value_states

    def append_rows(self, key_states, value_states, rows: list[int]):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = [], []
        for i, r in enumerate(rows):
            k, v = key_states[i:i + 1], value_states[i:i + 1]
            if self.rows[r] is None:
                self.rows[r] = self._new_row(k, v)
                keys.append(k[0])
                values.append(v[0])
            else:
                full_k, full_v = self.rows[r].update(k, v)
                keys.append(full_k[0])
                values.append(full_v[0])
        width = max(x.shape[-2] for x in keys)
        pad = lambda xs: torch.stack([F.pad(x, (0, 0, 0, width - x.shape[-2])) for x in xs])  # noqa: E731
        return pad(keys), pad(values)

    def row_lengths(self) -> list[int]:
        return [0 if x is None else x.get_seq_length() for x in self.rows]

    def trim(self, lengths: list[int]) -> None:
        for r, n in enumerate(lengths):
            layer = self.rows[r]
            if layer is not None and layer.get_seq_length() > n:
                if n > 0:
                    layer.crop(n - layer.get_seq_length())
                else:
                    self.rows[r] = None

    def nbytes(self) -> int:
        seen = {id(x): x for x in self.rows if x is not None}
        return sum(x.nbytes() for x in seen.values())

    def _take(self, rows) -> None:
        picked, used = [], set()
        for r in rows:
            layer = self.rows[r]
            if layer is not None and id(layer) in used:
                layer = layer.shallow_copy()
            elif layer is not None:
                used.add(id(layer))
            picked.append(layer)
        self.rows = picked

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._take(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._take([r for r in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._take(torch.arange(len(self.rows))[torch.as_tensor(indices).cpu()].reshape(-1).tolist())

    def reset(self) -> None:
        self.rows = []
        self.is_initialized = False

    def _move(self, device) -> None:
        for layer in self.rows:
            if layer is not None:
                layer._map(lambda t: t.to(device, non_blocking=True))


class SpiralStateLayer(DynamicLayer):
    """Decode state of one iteration, packed fp32 (b, 1, 1, 2 + 2d + g) = [m, Z, S, v_last, β_last] in `keys`
    (`values` aliases it), so reorder / repeat / select move it like K/V. `seen` (host int) counts the tokens it
    covers.

    Crop: the open-chunk accumulators cannot be recomputed backwards, so the layer keeps, for the tokens of the latest
    decoding call only, the state before each of them and the core rows' latent counts (`snapshot`). A crop back into
    that call restores them (`pending_lengths` tells the model how far to cut the core rows at its next call); a
    deeper crop (into a prefill, or an earlier call) sets `seen` to None and the next forward rebuilds the loop slots
    from the kept tokens' stored inputs (`SpiralFormerModel._rebuild_after_crop`). Both are exact."""

    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: int | None = None
        self.history: dict[int, tuple] = {}  # seen -> (packed state, core row lengths) before that token
        self.pending_lengths: list[int] | None = None

    def store(self, packed: torch.Tensor, seen: int) -> None:
        if not self.is_initialized:
            self.lazy_initialization(packed, packed)
        self.keys = self.values = packed
        self.seen = seen

    def snapshot(self, core_lengths: list[int]) -> None:
        """Remember the state as it is before the next token (tensors are replaced, never written in place)."""
        if self.seen is not None:
            self.history[self.seen] = (self.keys, list(core_lengths))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        target = None if self.seen is None else self.seen - abs(tokens_to_remove)
        if target is None or target not in self.history:
            self.seen, self.history, self.pending_lengths = None, {}, None
            return
        packed, self.pending_lengths = self.history[target]
        self.keys = self.values = packed
        self.seen = target
        self.history = {k: v for k, v in self.history.items() if k < target}

    def _invalidate(self) -> None:
        """A batch operation: the snapshots (and any pending core cut) no longer match the rows."""
        if self.pending_lengths is not None:
            self.seen = None
        self.history, self.pending_lengths = {}, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._invalidate()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._invalidate()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._invalidate()
        super().batch_select_indices(indices)

    def reset(self) -> None:
        super().reset()
        self.seen, self.history, self.pending_lengths = None, {}, None


class _CoreCacheView:
    """Cache proxy for the shared core layers of iteration t: `layer_idx` → `offset + layer_idx` on `SpiralCoreLayer`s.
    Prefill (`keep`): every row keeps its first keep[r] latents. Decode (`rows`): the triggering rows append one."""

    def __init__(self, cache: Cache, offset: int, keep: list[int] | None = None, rows: list[int] | None = None):
        self._cache, self._offset, self._keep, self._rows = cache, offset, keep, rows

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self._cache.layers[layer_idx + self._offset]
        if self._rows is None:
            return layer.write_prefill(key_states, value_states, self._keep)
        return layer.append_rows(key_states, value_states, self._rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._cache.layers[layer_idx + self._offset].get_seq_length()

    def __getattr__(self, name):
        return getattr(self._cache, name)


_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


def _check_attn(impl) -> None:
    check_attn_implementation(impl, "SpiralFormer", _ATTN_IMPLEMENTATIONS,
                              reason="its chunk latents and left-padded rows need explicit masks (float masks for "
                                     "eager/sdpa, a BlockMask for flex_attention); flash-attention kernels are not "
                                     "enabled for SpiralFormer")


def build_mask(impl: str, mask_mod, batch: int | None, q_len: int, kv_len: int, device, dtype):
    """One attention mask for every layer of a call. `mask_mod(b, h, q, kv) -> bool` (True = may attend; batch None =
    the same for every row) becomes a flex `BlockMask`, or is evaluated on broadcast index grids into a float
    additive mask (0 / finfo.min) for eager and sdpa."""
    if impl == "flex_attention":
        return block_mask(mask_mod, batch, q_len, kv_len, device)

    def grid(n, dim):
        return torch.arange(n, device=device).view([-1 if i == dim else 1 for i in range(4)])

    allowed = mask_mod(grid(batch or 1, 0), grid(1, 1), grid(q_len, 2), grid(kv_len, 3))
    return additive_mask(allowed.expand(batch or 1, 1, q_len, kv_len), dtype)


def _pad_seq(x: torch.Tensor, left: int, right: int = 0, value: float = 0.0) -> torch.Tensor:
    """Pad dim 1 of a (b, L) or (b, L, d) tensor."""
    if x.dim() == 2:
        return F.pad(x, (left, right), value=value)
    return F.pad(x, (0, 0, left, right), value=value)


# ----------------------------------------------------------------------------------------------------------------------
# Pretrained base
# ----------------------------------------------------------------------------------------------------------------------


class SpiralFormerPreTrainedModel(PreTrainedModel):
    """Attention backends: `attn_implementation` "eager", "sdpa" or "flex_attention" (CPU and GPU). Every SpiralFormer
    attention call is causal plus key padding (token stream: left padding; chunk latents: causal; decode core calls:
    each triggering row sees only its own closed latents), and the masks are built once per call by `build_mask`:
    float additive masks for eager/sdpa, a `BlockMask` for flex_attention. flash_attention_2/3 are refused with a
    ValueError at load time (`_supports_flash_attn = False`): the masks could be expressed as 2-D padding masks, but
    that path has not been verified on a GPU, and a silently wrong kernel is worse than a clear error."""

    config: SpiralFormerConfig
    config_class = SpiralFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        _check_attn(f"flash_attention_{flash_attn_version}")  # raises: names the supported values
        return False

    def _init_weights(self, module):
        super()._init_weights(module)
        role = getattr(module, "_spiral_init", None)
        if role is None:
            return
        if role == "zeros":  # scorers A and allocators B: training starts as mean pooling / uniform broadcast
            init.zeros_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif role == "depth_scaled":  # o_proj / down_proj: std × 1/√(2·N_compute) (Megatron's output-layer scaling)
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_virtual_layers)
            init.normal_(module.weight, mean=0.0, std=std)
        elif role == "identity_router":  # all writes and reads go to slot 1 (the loop starts as Anchor)
            init.zeros_(module.weight)
            bias = torch.zeros_like(module.bias)
            bias[1] = 30.0
            init.copy_(module.bias, bias)


# ----------------------------------------------------------------------------------------------------------------------
# Base model
# ----------------------------------------------------------------------------------------------------------------------


class SpiralFormerModel(SpiralFormerPreTrainedModel):
    def __init__(self, config: SpiralFormerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        n_phys = config.num_pre_layers + config.num_loop_layers + config.num_post_layers
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(n_phys)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        d = config.hidden_size
        self.scorers = nn.ModuleDict()
        self.allocators = nn.ModuleDict()
        for t, g in enumerate(config.chunk_sizes):
            if g == 1:  # g = 1 is a plain loop step: no scorer, no allocator
                continue
            if config.downscale == "self_aggregation":
                self.scorers[str(t)] = nn.Linear(d, 1, bias=False)
                self.scorers[str(t)]._spiral_init = "zeros"
            if config.upscale == "output_dependent":
                self.allocators[str(t)] = nn.Linear(d, g, bias=True)
                self.allocators[str(t)]._spiral_init = "zeros"
        self.routers = None
        if config.topology == "mesh":
            B = config.mesh_slots
            self.routers = nn.ModuleDict(
                {
                    name: nn.ModuleDict(
                        {str(t): nn.Linear(d, B, bias=True) for t in range(len(config.chunk_sizes) + 1)}
                    )
                    for name in ("write", "read")
                }
            )
            if config.router_init == "identity":
                for group in self.routers.values():
                    for lin in group.values():
                        lin._spiral_init = "identity_router"
        if config.depth_scaled_init:
            for layer in self.layers:
                layer.self_attn.o_proj._spiral_init = "depth_scaled"
                layer.mlp.down_proj._spiral_init = "depth_scaled"
        self.layout = _SlotLayout(config)
        self.gradient_checkpointing = False
        self.post_init()

    # --- layer groups -------------------------------------------------------------------------------------------------

    @property
    def pre_layers(self):
        return self.layers[: self.config.num_pre_layers]

    @property
    def core_layers(self):
        n = self.config.num_pre_layers
        return self.layers[n : n + self.config.num_loop_layers]

    @property
    def post_layers(self):
        return self.layers[self.config.num_pre_layers + self.config.num_loop_layers :]

    def _run(self, layers, h, mask, pos, view, use_cache, collect=None, **kwargs):
        """Apply `layers` with one prebuilt mask; `view` is the cache proxy of this layer group (or None)."""
        pos_emb = self.rotary_emb(h, pos)
        for layer in layers:
            if collect is not None:
                collect.hidden.append(h)
            h = layer(h, attention_mask=mask, position_ids=pos, cache=view, use_cache=use_cache,
                      position_embeddings=pos_emb, **kwargs)
        return h

    def _mask(self, mask_mod, batch, q_len, kv_len, like):
        """The attention mask of one call shape for the configured backend (see `build_mask`)."""
        return build_mask(self.config._attn_implementation, mask_mod, batch, q_len, kv_len, like.device, like.dtype)

    def _token_view(self, cache, offset):
        return LoopCacheView(cache, offset) if cache is not None else None

    # --- operators shared by the full forward and decoding ------------------------------------------------------------

    def _scores(self, t: int, h: torch.Tensor) -> torch.Tensor | None:
        """Self-aggregation scores A(t)(h) in fp32 (None for mean pooling / g = 1)."""
        key = str(t)
        if key not in self.scorers:
            return None
        return self.scorers[key](h).squeeze(-1).float()

    def _allocation(self, t: int, zhat: torch.Tensor) -> torch.Tensor:
        """β over the g readers of each latent (fp32 softmax; uniform 1/g without an allocator)."""
        g = self.config.chunk_sizes[t]
        key = str(t)
        if key not in self.allocators:
            return torch.full((*zhat.shape[:-1], g), 1.0 / g, dtype=zhat.dtype, device=zhat.device)
        return torch.softmax(self.allocators[key](zhat).float(), dim=-1).to(zhat.dtype)

    def _route(self, index: int, h: torch.Tensor):
        """MeSH write/read weights of step `index` (0 = transitional, t + 1 = loop step t), fp32 softmax over slots."""
        w_write = torch.softmax(self.routers["write"][str(index)](h).float(), dim=-1).to(h.dtype)
        w_read = torch.softmax(self.routers["read"][str(index)](h).float(), dim=-1).to(h.dtype)
        return w_write, w_read

    @staticmethod
    def _mesh_write_read(memory, update, w_write, w_read):
        """M ← M + w_write ⊙ update (one scalar per token and slot); h = Σ_b w_read,b ⊙ M_b."""
        memory = memory + w_write.unsqueeze(-1) * update.unsqueeze(-2)
        return memory, (w_read.unsqueeze(-1) * memory).sum(-2)

    def _core(self, t, z, lat_pos, mask, view, use_cache, **kwargs):
        """Shared core on latents (`view`: the core cache proxy or None); returns (ẑ, v), v = ẑ or ẑ − z."""
        zhat = self._run(self.core_layers, z, mask, lat_pos, view, use_cache, **kwargs)
        v = zhat - z if self.config.core_output == "delta" else zhat
        return zhat, v

    # --- one loop step over a whole sequence ----------------------------------------------------------------------

    def spiral_step(self, h, t, pos, valid, aligned, cache=None, use_cache=False, force_gather=False, **kwargs):
        """ũ(t) for every token of `h` (b, L, d). `pos` (b, L) token positions, `valid` (b, L) real-token mask.

        `aligned` (no padding, positions 0..L−1 in every row) takes the reshape path of the spec; otherwise (or with
        `force_gather`) chunk membership and the read map come from per-row positions (closed-form gather).
        When `cache` is given (prefill), each row keeps the core K/V of its own closed latents and the decode state.
        """
        g = self.config.chunk_sizes[t]
        omega = chunk_offset(self.config, g)
        b, L, d = h.shape
        fast = aligned and not force_gather
        scores = self._scores(t, h)
        n_real = torch.where(valid, pos, torch.full_like(pos, -1)).amax(dim=1) + 1  # tokens per row (b,)
        lt_row = torch.div(n_real + omega, g, rounding_mode="floor")  # closed chunks per row
        lt_host = lt_row.tolist()
        Lt = max(lt_host, default=0)
        caching = cache is not None and use_cache
        v = beta = None
        if Lt > 0:
            z = self._downscale(t, h, scores, pos, valid, Lt, fast)
            j = torch.arange(Lt, device=h.device)
            lat_pos = latent_position_ids(self.config, g, j).unsqueeze(0).expand(b, Lt)
            lat_mask = self._mask(lambda bi, hi, q, kv: kv <= q, None, Lt, Lt, h)  # causal over latents
            view = _CoreCacheView(cache, self.layout.core_offset(t), keep=lt_host) if caching else None
            zhat, v = self._core(t, z, lat_pos, lat_mask, view, use_cache, **kwargs)
            beta = self._allocation(t, zhat)  # (b, Lt, g)
            e = self._upscale(t, v, beta, pos, valid, L, fast)
        else:
            e = torch.zeros_like(h)
        if caching:
            self._write_prefill_state(cache, t, h, scores, pos, valid, lt_row, Lt, v, beta)
        return e

    def _downscale(self, t, h, scores, pos, valid, Lt, fast):
        """z (b, Lt, d): the latents of the Lt closed chunks, from the (b, Lt, g) padded frame (down-scaling);
        virtual members of chunk 0 and (gather path) absent or padded members are masked out."""
        g = self.config.chunk_sizes[t]
        omega = chunk_offset(self.config, g)
        b, L, d = h.shape
        P = Lt * g
        if fast:
            hp = _pad_seq(h, omega)[:, :P]
            sp = _pad_seq(scores, omega, value=_NEG)[:, :P] if scores is not None else None
            member = _pad_seq(torch.ones(b, L, device=h.device), omega)[:, :P] > 0.5
        else:
            fidx = pos + omega
            inframe = valid & (fidx < P)
            inv = torch.full((b, P + 1), L, dtype=torch.long, device=h.device)
            target = torch.where(inframe, fidx, torch.full_like(fidx, P))  # non-members go to a dump slot P
            inv.scatter_(1, target, torch.arange(L, device=h.device).expand(b, L))
            inv = inv[:, :P]
            member = inv < L
            hp = torch.gather(_pad_seq(h, 0, 1), 1, inv.unsqueeze(-1).expand(b, P, d))
            sp = torch.gather(_pad_seq(scores, 0, 1, value=_NEG), 1, inv) if scores is not None else None
        hp = hp.reshape(b, Lt, g, d)
        if sp is None:
            return hp.sum(2) / g  # literal 1/g: virtual members count as zeros
        sp = sp.masked_fill(~member, _NEG).reshape(b, Lt, g)
        alpha = torch.softmax(sp, dim=-1).to(h.dtype)
        return (alpha.unsqueeze(-1) * hp).sum(2)

    def _upscale(self, t, v, beta, pos, valid, L, fast):
        """ũ (b, L, d): up-scaling u = λ β v and the causal shift."""
        g = self.config.chunk_sizes[t]
        omega, s, lam = chunk_offset(self.config, g), shift_of(self.config, g), math.sqrt(g)
        b, Lt, d = v.shape
        P = Lt * g
        if fast:
            u_pad = (lam * beta.unsqueeze(-1) * v.unsqueeze(2)).reshape(b, P, d)  # slot p ↔ token p − ω
            if self.config.shift_frame == "padded":
                return _pad_seq(u_pad, s, max(0, omega + L - s - P))[:, omega : omega + L]
            u = _pad_seq(u_pad[:, omega:], 0, max(0, L - (P - omega)))[:, :L]
            return _pad_seq(u, s)[:, :L]
        jr, kr, readable = reader_index(self.config, g, pos)
        readable = readable & valid
        jc = jr.clamp(0, Lt - 1)
        b_sel = torch.gather(beta, 1, jc.unsqueeze(-1).expand(b, L, g))
        b_sel = torch.gather(b_sel, 2, kr.unsqueeze(-1))  # (b, L, 1)
        v_sel = torch.gather(v, 1, jc.unsqueeze(-1).expand(b, L, d))
        return (lam * b_sel * v_sel) * readable.unsqueeze(-1).to(v.dtype)

    # --- cache bookkeeping --------------------------------------------------------------------------------------------

    # packed decode state of iteration t, fp32 (b, 1, 1, 2 + 2d + g): [m, Z, S (d), v_last (d), β_last (g)]

    def _pack_state(self, m, Z, S, v_last, beta_last):
        return torch.cat([m[:, None], Z[:, None], S, v_last, beta_last], dim=-1)[:, None, None, :]

    def _unpack_state(self, t, packed):
        d, g = self.config.hidden_size, self.config.chunk_sizes[t]
        x = packed[:, 0, 0, :]
        return x[:, 0], x[:, 1], x[:, 2 : 2 + d], x[:, 2 + d : 2 + 2 * d], x[:, 2 + 2 * d : 2 + 2 * d + g]

    def _prepare_cache(self, cache, batch_size: int) -> int:
        """Give the cache its SpiralFormer slots (generate builds a plain `DynamicCache`); a prefill (empty cache) also
        starts fresh ragged rows. Returns the number of cached tokens."""
        ensure_cache_slots(cache, self.layout.total)
        if type(cache.layers[self.layout.inputs]) is not DynamicLayer:
            cache.layers[self.layout.inputs] = DynamicLayer()
        quant = getattr(cache, "loop_kv_quant", None)  # a quantized loop cache: the core rows quantize too
        core = SpiralCoreLayer if quant is None else QuantizedSpiralCoreLayer
        wanted = [(i, core) for i in self.layout.core_slots()]
        wanted += [(self.layout.state_slot(t), SpiralStateLayer) for t in range(self.layout.T)]
        for i, cls in wanted:
            layer = cache.layers[i]
            if not isinstance(layer, cls):
                if layer.is_initialized and layer.get_seq_length() > 0:
                    raise ValueError(f"cache slot {i} holds a {type(layer).__name__} written by another model, "
                                     "not a SpiralFormer cache")
                cache.layers[i] = cls(quant) if cls is QuantizedSpiralCoreLayer else cls()
        past = cache.get_seq_length()
        if past == 0:
            for i in self.layout.core_slots():
                cache.layers[i].start(batch_size)
            for t in range(self.layout.T):
                cache.layers[self.layout.state_slot(t)].reset()
            inputs = cache.layers[self.layout.inputs]
            if inputs.get_seq_length() > 0:
                inputs.crop(-inputs.get_seq_length())
        return past

    def _check_state(self, cache, past: int) -> None:
        """The decode state must cover exactly the cached tokens (a crop is rebuilt before this check); a cache edited
        some other way is refused instead of giving a silently different answer."""
        seen = cache.layers[self.layout.state_slot(0)].seen  # host int: no device sync
        if seen != past:
            raise ValueError(
                f"SpiralFormer decode state covers {'a cropped cache' if seen is None else f'{seen} tokens'} but the "
                f"cache holds {past}: a SpiralFormer cache can be cropped (`cache.crop`), not edited otherwise"
            )

    def _record_inputs(self, cache, x, position_ids) -> None:
        """Keep the token stream's inputs (scaled embeddings) and RoPE positions of every cached token."""
        pos = position_ids.to(torch.float32)[:, None, :, None]  # exact up to 2^24
        cache.layers[self.layout.inputs].update(x[:, None], pos)

    def _finish_crop(self, cache, key_valid, past: int, **kwargs) -> None:
        """Bring the loop slots in line with a `cache.crop` since the last call: cut the core rows back to the
        restored snapshot, or rebuild everything when the crop went deeper than the snapshots; then start this call's
        snapshots afresh (only the latest call's tokens are kept)."""
        states = [cache.layers[self.layout.state_slot(t)] for t in range(self.layout.T)]
        if any(state.seen is None for state in states):
            self._rebuild_after_crop(cache, key_valid, past, **kwargs)
            return
        for t, state in enumerate(states):
            if state.pending_lengths is not None:
                for l in range(self.layout.n_loop):
                    cache.layers[self.layout.core_slot(t, l)].trim(state.pending_lengths)
            state.history, state.pending_lengths = {}, None

    def _rebuild_after_crop(self, cache, key_valid, past: int, **kwargs) -> None:
        """After `cache.crop`: the open-chunk accumulators and the closed latents of the kept tokens cannot be rolled
        back token by token, so every slot is rebuilt by prefilling the kept tokens again from their stored inputs —
        the very computation that decoding the shorter prefix runs. Costs one prefill of the kept tokens per crop."""
        inputs = cache.layers[self.layout.inputs]
        if inputs.get_seq_length() != past:
            raise ValueError(f"SpiralFormer cache holds {past} tokens but the inputs of {inputs.get_seq_length()}: "
                             "a SpiralFormer cache can be cropped (`cache.crop`), not edited otherwise")
        x, pos = inputs.keys[:, 0], inputs.values[:, 0, :, 0].long()
        for i in self.layout.token_slots():
            layer = cache.layers[i]
            if layer.get_seq_length() > 0:
                layer.crop(-layer.get_seq_length())
        for i in self.layout.core_slots():
            cache.layers[i].start(x.shape[0])
        for t in range(self.layout.T):
            cache.layers[self.layout.state_slot(t)].reset()
        self._forward_full(x, key_valid, pos, cache, True, **kwargs)

    def cache_bytes(self, cache) -> dict:
        """Bytes held by a SpiralFormer cache: `tokens` (pre/post K/V, b × width columns each), `core` (the ragged
        core K/V: exactly Σ_rows Σ_t N_loop·C_t,row latents), `state` (decode state), `inputs` (the token stream's
        inputs and positions, which make `crop` exact) and `kv` = tokens + core."""
        def dense(i):
            layer = cache.layers[i]
            return 0 if not layer.is_initialized else kv_layer_bytes(layer)

        out = {"tokens": sum(dense(i) for i in self.layout.token_slots()),
               "core": sum(cache.layers[i].nbytes() for i in self.layout.core_slots()),
               "state": sum(dense(self.layout.state_slot(t)) // 2 for t in range(self.layout.T)),  # keys is values
               "inputs": dense(self.layout.inputs) if self.layout.inputs < len(cache.layers) else 0}
        out["kv"] = out["tokens"] + out["core"]
        return out

    def _write_prefill_state(self, cache, t, h, scores, pos, valid, lt_row, Lt, v, beta):
        """Decode state after a prefill: open-chunk accumulator and last closed latent of every row."""
        g = self.config.chunk_sizes[t]
        omega = chunk_offset(self.config, g)
        b, L, d = h.shape
        # open chunk = the chunk index lt_row of each row
        open_member = valid & (torch.div(pos + omega, g, rounding_mode="floor") == lt_row[:, None])
        a = scores if scores is not None else torch.zeros(b, L, dtype=torch.float32, device=h.device)
        a = a.masked_fill(~open_member, _NEG)
        m = a.amax(dim=1)
        m = torch.where(open_member.any(1), m, torch.full_like(m, _NEG))
        w = torch.exp(a - m[:, None]) * open_member.float()
        Z = w.sum(1)
        S = (w.unsqueeze(-1) * h.float()).sum(1)
        if Lt > 0:
            last = (lt_row - 1).clamp(min=0)
            has = (lt_row > 0).float()[:, None]
            v_last = v.float()[torch.arange(b, device=h.device), last] * has
            beta_last = beta.float()[torch.arange(b, device=h.device), last] * has
        else:
            v_last = torch.zeros(b, d, dtype=torch.float32, device=h.device)
            beta_last = torch.zeros(b, g, dtype=torch.float32, device=h.device)
        cache.layers[self.layout.state_slot(t)].store(self._pack_state(m, Z, S, v_last, beta_last), seen=L)

    # --- one token against the cache -------------------------------------------------------------------------------

    def _decode_level(self, t, h, pos, valid, trigger, rows, cache, **kwargs):
        """ũ(t) for one new token per row (h: (b, 1, d); pos, valid, trigger: (b,)) and the cache update of iteration
        t. `rows` (host list) are the rows whose chunk closes at this token: only they go through the core."""
        cfg = self.config
        g = cfg.chunk_sizes[t]
        lam = math.sqrt(g)
        b, _, d = h.shape
        state = cache.layers[self.layout.state_slot(t)]
        state.snapshot(cache.layers[self.layout.core_slot(t, 0)].row_lengths())  # host ints: no device sync
        m, Z, S, v_last, beta_last = self._unpack_state(t, state.keys)

        def read(v_last, beta_last):
            j, k, readable = reader_index(cfg, g, pos)
            coef = beta_last.gather(1, k[:, None]) * (readable & valid).float()[:, None]
            return (lam * coef * v_last).to(h.dtype)[:, None, :]

        e = read(v_last, beta_last) if cfg.shift == "no_overlap" else None  # no overlap: read before the trigger

        # online softmax (fp32) over the open chunk, before the trigger test
        scores = self._scores(t, h)
        a = scores[:, 0] if scores is not None else torch.zeros(b, dtype=torch.float32, device=h.device)
        m_new = torch.maximum(m, a)
        keep, add = torch.exp(m - m_new), torch.exp(a - m_new)
        m = torch.where(valid, m_new, m)
        Z = torch.where(valid, Z * keep + add, Z)
        S = torch.where(valid[:, None], S * keep[:, None] + add[:, None] * h[:, 0].float(), S)

        if rows:  # chunks close: run the core on those rows only, scatter their latents back, reset their accumulators
            z = S / Z.clamp(min=1e-30)[:, None] if scores is not None else S / g
            idx, v_new, beta_new = self._close_chunks(t, z.to(h.dtype), pos, trigger, rows, cache, **kwargs)
            v_last = v_last.index_copy(0, idx, v_new)
            beta_last = beta_last.index_copy(0, idx, beta_new)
            m, Z, S = m.index_fill(0, idx, _NEG), Z.index_fill(0, idx, 0.0), S.index_fill(0, idx, 0.0)
        state.store(self._pack_state(m, Z, S, v_last, beta_last), seen=state.seen + 1)
        return e if e is not None else read(v_last, beta_last)

    def _close_chunks(self, t, z, pos, trigger, rows, cache, **kwargs):
        """Core pass of iteration t on the k = len(rows) triggering rows only. z: (b, d) pooled latents of every row.
        Returns their device row indices (k,) and their v, β (fp32). No host sync: `rows` already lives on the host,
        and the device indices are the first k of a stable sort that puts triggering rows first."""
        cfg = self.config
        g = cfg.chunk_sizes[t]
        k = len(rows)
        idx = torch.sort(trigger.to(torch.int8), descending=True, stable=True).indices[:k]
        j_new = torch.div(pos.index_select(0, idx) + chunk_offset(cfg, g) + 1, g, rounding_mode="floor") - 1
        lengths = cache.layers[self.layout.core_slot(t, 0)].row_lengths()
        width = max(lengths[r] for r in rows) + 1
        # row i's keys: its j_new[i] closed latents, then the new one at column j_new[i], then padding. (A dense (k, W)
        # table rather than `kv <= j_new[b]`: torch 2.13's compiled CPU flex kernel fails on the latter once the
        # batch size varies between calls.)
        visible = torch.arange(width, device=z.device)[None, :] <= j_new[:, None]
        mask = self._mask(lambda bi, hi, q, kv: visible[bi, kv], k, 1, width, z)
        view = _CoreCacheView(cache, self.layout.core_offset(t), rows=rows)
        zhat, v = self._core(t, z.index_select(0, idx)[:, None, :], latent_position_ids(cfg, g, j_new)[:, None],
                             mask, view, True, **kwargs)
        return idx, v[:, 0].float(), self._allocation(t, zhat)[:, 0].float()

    # --- forward ------------------------------------------------------------------------------------------------------

    @can_return_tuple
    @accepts_cache_kwarg
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`output_hidden_states`: the full-resolution residual stream — the input of every pre layer, the token
        stream after every resolution step, the input of every post layer, and the final-normed output (full
        forward only). The loops' compressed latents and their attention come from `hf_loops.analysis.capture_trace`;
        `output_attentions` is refused for that reason."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        _check_attn(self.config._attn_implementation)
        if output_attentions if output_attentions is not None else self.config.output_attentions:
            raise ValueError("output_attentions is not supported by SpiralFormer: its loops attend over compressed "
                             "latents of varying length; use hf_loops.analysis.capture_trace for attention maps")
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        collect = LayerCollector(want_hidden=True, want_attentions=False) if want_hidden else None
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise ValueError(
                "SpiralFormer does not support packed (padding-free) batches: chunks would straddle documents"
            )
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            kwargs.pop(key, None)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        x = inputs_embeds
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.hidden_size)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # checkpointed layers drop the cache anyway; keep the bookkeeping consistent
        if use_cache and cache is None:
            cache = DynamicCache()
        if not use_cache:
            cache = None
        b, L, _ = x.shape
        past = self._prepare_cache(cache, b) if cache is not None else 0

        attention_mask = plain_attention_mask(attention_mask)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("SpiralFormer takes a 2-D padding attention_mask (batch, past + new tokens)")
        if attention_mask is not None and attention_mask.shape[1] != past + L:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} tokens, expected past ({past}) + new ({L})"
            )
        if attention_mask is not None:
            key_valid = attention_mask.bool()
        else:
            key_valid = torch.ones(b, past + L, dtype=torch.bool, device=x.device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, past, L, x.device)
        position_ids = position_ids.to(x.device).expand(b, L)
        if past == 0 and attention_mask is None and L > 1 and bool((position_ids[:, 1:] <= position_ids[:, :-1]).any()):
            raise ValueError("SpiralFormer does not support packed (padding-free) batches: position_ids must increase")

        if collect is not None and past > 0:
            raise ValueError("output_hidden_states needs a full forward (no past cache) in SpiralFormer: decoding "
                             "steps run the loops incrementally and have no per-layer stream to return")
        if cache is not None:
            if past > 0:
                self._finish_crop(cache, key_valid[:, :past], past, **kwargs)
            self._record_inputs(cache, x, position_ids)
        if past == 0:
            h = self._forward_full(x, key_valid, position_ids, cache, use_cache, collect=collect, **kwargs)
        else:
            outs = []
            for i in range(L):  # extending a non-empty cache: one token at a time (the decode path keeps the chunk state exact)
                tok_valid = key_valid[:, : past + i + 1]
                outs.append(self._forward_token(x[:, i : i + 1], tok_valid, position_ids[:, i], cache, **kwargs))
            h = torch.cat(outs, dim=1)
        h = self.norm(h)
        return BaseModelOutputWithPast(last_hidden_state=h, cache=cache,
                                       hidden_states=collect.hidden_states(h) if collect is not None else None)

    def _forward_full(self, x, key_valid, pos, cache, use_cache, force_gather=False, collect=None, **kwargs):
        b, L, _ = x.shape
        valid = key_valid[:, -L:]
        aligned = bool(valid.all()) and bool((pos == torch.arange(L, device=x.device)).all())
        if aligned:
            tok_mask = self._mask(lambda bi, hi, q, kv: kv <= q, None, L, L, x)
        else:  # causal over the row's real tokens (left padding)
            tok_mask = self._mask(lambda bi, hi, q, kv: (kv <= q) & valid[bi, kv], b, L, L, x)
        h = self._run(self.pre_layers, x, tok_mask, pos, self._token_view(cache, self.layout.pre_offset()), use_cache,
                      collect, **kwargs)

        def step(h, t):
            if collect is not None and t > 0:
                collect.hidden.append(h)  # the token stream after resolution step t − 1
            return self.spiral_step(h, t, pos, valid, aligned, cache, use_cache, force_gather=force_gather, **kwargs)

        h = self._topology_loop(x, h, step)
        return self._run(self.post_layers, h, tok_mask, pos, self._token_view(cache, self.layout.post_offset()),
                         use_cache, collect, **kwargs)

    def _topology_loop(self, x, h, step):
        """Run the T resolution steps on the pre-stack output `h`; `step(h, t)` returns iteration t's token update.

        Anchor: h(t+1) = h(0) + update. MeSH: transitional write–read of h(0) into a buffer seeded with the embeddings,
        then per step a write of the update and a read with routers computed from h(t) (MeSH)."""
        mesh = self.config.topology == "mesh"
        if mesh:
            memory = torch.zeros(*x.shape[:2], self.config.mesh_slots, x.shape[-1], dtype=x.dtype, device=x.device)
            memory[:, :, 0] = x
            w_write, w_read = self._route(0, x)
            memory, h = self._mesh_write_read(memory, h, w_write, w_read)
        h0 = h
        for t in range(len(self.config.chunk_sizes)):
            e = step(h, t)
            if mesh:
                w_write, w_read = self._route(t + 1, h)
                memory, h = self._mesh_write_read(memory, e, w_write, w_read)
            else:
                h = h0 + e
        return h

    def _forward_token(self, x, key_valid, pos, cache, **kwargs):
        """One token per row (x: (b, 1, d)) against a non-empty cache.

        The step's only host sync reads, for every iteration at once, which rows close a chunk at this token
        (ρ_t(i) = g_t − 1); each iteration then runs its core on exactly those rows."""
        b, past = x.shape[0], key_valid.shape[1] - 1
        self._check_state(cache, past)
        valid = key_valid[:, -1]
        triggers = torch.stack([valid & ((pos + chunk_offset(self.config, g) + 1) % g == 0)
                                for g in self.config.chunk_sizes])
        rows = [[r for r, fired in enumerate(level) if fired] for level in triggers.tolist()]  # the one host sync
        tok_mask = self._mask(lambda bi, hi, q, kv: key_valid[bi, kv], b, 1, past + 1, x)
        pos2 = pos[:, None]
        h = self._run(self.pre_layers, x, tok_mask, pos2, self._token_view(cache, self.layout.pre_offset()), True,
                      **kwargs)
        h = self._topology_loop(
            x, h, lambda h, t: self._decode_level(t, h, pos, valid, triggers[t], rows[t], cache, **kwargs))
        return self._run(self.post_layers, h, tok_mask, pos2, self._token_view(cache, self.layout.post_offset()), True,
                         **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# Causal LM
# ----------------------------------------------------------------------------------------------------------------------


class SpiralFormerForCausalLM(QuantizedLoopCacheMixin, LoopedContinuousBatchingMixin, SpiralFormerPreTrainedModel,
                              GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor / pipeline parallelism as Qwen3ForCausalLM: the backbone's plan comes from the config (Qwen3's
    # `base_model_tp_plan`), the LM head is column-sharded with gathered logits; the loop's own modules are replicated.
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: SpiralFormerConfig):
        super().__init__(config)
        self.model = SpiralFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def continuous_batching_refusal(cls, config) -> str | None:
        return ("its looped layers attend over chunk latents (one entry per completed chunk of tokens, rewritten as "
                "the chunk fills), which transformers' paged cache (one entry per token and layer) cannot hold; use "
                "generate")

    @can_return_tuple
    @accepts_cache_kwarg
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)


__all__ = ["SpiralFormerPreTrainedModel", "SpiralFormerModel", "SpiralFormerForCausalLM"]
