"""Quantized loop cache: int8 / int4 keys and values for the per-(iteration, layer) cache slots of the looped models.

    generate(..., cache_implementation="quantized", cache_config={"nbits": 8, "residual_length": 32})

transformers' `QuantizedCache` does not fit our layout: it is not a `DynamicCache` (the looped models grow
`cache.layers` in place, one slot per iteration and layer), its layers expose only the full-precision residual as
`keys` / `values` (our caches read and rewrite `layer.keys` as the whole stored sequence: TaH2's ragged streams gather
and `index_select` entries, crops cut columns), it cannot crop, and its backends (optimum-quanto, HQQ) are not
installed; its fp8 backend freezes one per-tensor scale at the first write, which a ragged stream's first few entries
set badly. So this file quantizes itself, behind `QuantizedLoopLayer`, a `DynamicLayer` whose `keys` / `values` read
back the dequantized sequence: every cache operation our models run works on it unchanged.

Grouping: per token, over groups of `q_group_size` head-dim channels (default: the whole head dim). Each stored entry
(b, h, t) carries its own scale, so an entry's codes never depend on its neighbours: TaH2's ragged streams (flat
entries in arrival order, regathered per call), crops, beam reorder and batch select move codes and scales as they
are, with no re-quantization and no drift. (KIVI-style per-channel keys share one scale over a group of tokens along
the sequence, which every such move would have to re-quantize.) Outlier channels are what the fp residual window
and smaller groups are for.

- int8: symmetric, codes in [−127, 127], scale = amax / 127 (fp16, rounded up, at least fp16's smallest normal
  6.1e-5) → |x − x̂| ≤ scale / 2 ≤ max(amax / 127 · (1 + 2^-9), 6.1e-5) / 2.
- int4: asymmetric, codes in [0, 15] packed two per byte, zero point = group min (fp16, rounded down), scale =
  (max − min) / 15 (fp16, rounded up) → |x − x̂| ≤ scale / 2.
- residual window: the last `residual_length` entries of each slot stay in the model's dtype (as transformers'
  `QuantizedLayer`); older entries are quantized once, when they leave the window. A call's own new entries are always
  attended to in full precision.

Stored bytes per entry (K or V) of head dim D, group G: int8 D + 2·D/G, int4 D/2 + 4·D/G (vs 4·D in fp32).

This file ships as Hub remote code next to the modeling files: it imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["LoopKVQuantConfig", "QuantizedLoopLayer", "QuantizedKV", "quantize_kv", "dequantize_kv", "kv_layer_bytes",
           "QUANTIZED_CACHE_KEYS", "QUANTIZED_NBITS", "quantized_loop_cache_config", "enable_quantized_loop_cache"]

QUANTIZED_NBITS = (4, 8)
QUANTIZED_CACHE_KEYS = ("backend", "nbits", "residual_length", "q_group_size")
LOOP_BACKEND = "loop"


@dataclass(frozen=True)
class LoopKVQuantConfig:
    """`nbits` ∈ {4, 8}; `residual_length` ≥ 0 recent entries per slot kept unquantized; `q_group_size` head-dim
    channels per scale (None: the whole head dim; must divide it, and be even at int4)."""

    nbits: int = 8
    residual_length: int = 32
    q_group_size: int | None = None

    def __post_init__(self):
        if isinstance(self.nbits, bool) or self.nbits not in QUANTIZED_NBITS:
            raise ValueError(f"cache_config['nbits'] must be one of {list(QUANTIZED_NBITS)}, got {self.nbits!r}")
        if isinstance(self.residual_length, bool) or not isinstance(self.residual_length, int) or self.residual_length < 0:
            raise ValueError(f"cache_config['residual_length'] must be an int >= 0, got {self.residual_length!r}")
        g = self.q_group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1 or (self.nbits == 4 and g % 2)):
            allowed = "an even int >= 2" if self.nbits == 4 else "an int >= 1"
            raise ValueError(f"cache_config['q_group_size'] must be None or {allowed} dividing head_dim, got {g!r}")

    def group(self, head_dim: int) -> int:
        g = head_dim if self.q_group_size is None else self.q_group_size
        if head_dim % g or (self.nbits == 4 and g % 2):
            raise ValueError(f"cache_config['q_group_size'] = {g} must divide head_dim = {head_dim}"
                             + (" and be even at nbits=4" if self.nbits == 4 else ""))
        return g


def quantized_loop_cache_config(cache_config: dict | None) -> LoopKVQuantConfig:
    """`generate`'s `cache_config` (for cache_implementation="quantized") → the loop cache's settings; unknown keys and
    other backends are refused with the allowed values."""
    cache_config = dict(cache_config or {})
    unknown = sorted(set(cache_config) - set(QUANTIZED_CACHE_KEYS))
    if unknown:
        raise ValueError(f"cache_config keys must be among {list(QUANTIZED_CACHE_KEYS)} for the looped models' "
                         f"quantized cache, got {unknown}")
    backend = cache_config.pop("backend", LOOP_BACKEND)
    if backend != LOOP_BACKEND:
        raise ValueError(
            f"cache_config['backend'] must be {LOOP_BACKEND!r} for a looped model, got {backend!r}: transformers' "
            "QuantizedCache backends cannot hold per-iteration cache slots (docs/quantization.md)")
    return LoopKVQuantConfig(**cache_config)


def enable_quantized_loop_cache(cache, config: LoopKVQuantConfig):
    """Mark a `DynamicCache` so that its key/value slots quantize (slots added later by `ensure_cache_slots` too);
    empty plain layers already there are replaced. Returns the cache."""
    if cache.get_seq_length() > 0:
        raise ValueError("a quantized loop cache must start empty")
    cache.loop_kv_quant = config
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and is_kv_slot(cache, i):
            cache.layers[i] = QuantizedLoopLayer(config)
    return cache


def is_kv_slot(cache, index: int) -> bool:
    """Does slot `index` hold keys/values (not metadata)? A cache class says so through `is_kv_slot`."""
    fn = getattr(type(cache), "is_kv_slot", None)
    return True if fn is None else fn(cache, index)


def new_cache_layer(cache, index: int) -> DynamicLayer:
    """The layer a looped model adds at slot `index`: quantized when the cache is a quantized loop cache."""
    config = getattr(cache, "loop_kv_quant", None)
    if config is not None and is_kv_slot(cache, index):
        return QuantizedLoopLayer(config)
    return DynamicLayer()


# ----------------------------------------------------------------------------------------------------------------------
# Quantize / dequantize: per token, groups of head-dim channels
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class QuantizedKV:
    """Codes of (..., T, D) states: int8 (..., T, D) or packed int4 uint8 (..., T, D/2); fp16 `scale` (and int4 `zero`)
    (..., T, D/G)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    nbits: int
    dtype: torch.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def length(self) -> int:
        return self.codes.shape[-2]

    def map(self, fn) -> QuantizedKV:
        """The same entries through a shape op `fn` on the batch / token dims (index_select, slicing, repeat)."""
        return QuantizedKV(fn(self.codes), fn(self.scale), None if self.zero is None else fn(self.zero), self.nbits,
                           self.dtype)

    @staticmethod
    def cat(parts: list[QuantizedKV]) -> QuantizedKV:
        parts = [p for p in parts if p is not None]
        if len(parts) == 1:
            return parts[0]
        zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts], dim=-2)
        return QuantizedKV(torch.cat([p.codes for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                           zero, parts[0].nbits, parts[0].dtype)


_F16_TINY = torch.finfo(torch.float16).tiny


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """fp16 ≥ x (x ≥ 0): scales rounded up, so no code overflows its range."""
    return (x.clamp(min=_F16_TINY) * (1 + 2**-10)).to(torch.float16)


def quantize_kv(x: torch.Tensor, nbits: int, group: int) -> QuantizedKV:
    """(..., T, D) → codes; each (…, t) entry and group of `group` channels gets its own scale."""
    *lead, D = x.shape
    xg = x.detach().float().reshape(*lead, D // group, group)
    if nbits == 8:
        scale = _half_up(xg.abs().amax(-1) / 127)
        codes = torch.round(xg / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8).reshape(*lead, D)
        return QuantizedKV(codes, scale, None, 8, x.dtype)
    lo = xg.amin(-1)
    zero = lo.to(torch.float16)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)  # ≤ lo
    scale = _half_up((xg.amax(-1) - zero.float()) / 15)
    q = torch.round((xg - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(*lead, D)
    return QuantizedKV(q[..., 0::2] | (q[..., 1::2] << 4), scale, zero, 4, x.dtype)


def dequantize_kv(q: QuantizedKV) -> torch.Tensor:
    if q.nbits == 8:
        *lead, D = q.codes.shape
        G = q.scale.shape[-1]
        x = q.codes.float().reshape(*lead, G, D // G) * q.scale.float()[..., None]
        return x.reshape(*lead, D).to(q.dtype)
    *lead, half = q.codes.shape
    codes = torch.stack([q.codes & 15, q.codes >> 4], dim=-1).reshape(*lead, 2 * half).float()
    G = q.scale.shape[-1]
    x = codes.reshape(*lead, G, 2 * half // G) * q.scale.float()[..., None] + q.zero.float()[..., None]
    return x.reshape(*lead, 2 * half).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The cache layer
# ----------------------------------------------------------------------------------------------------------------------


class QuantizedLoopLayer(DynamicLayer):
    """A `DynamicLayer` storing its (B, H, S, D) keys and values as per-token int8 / int4 codes plus an fp window of
    the last `residual_length` entries. `keys` / `values` read back the whole dequantized sequence (assigning them
    stores a new sequence, quantizing what lies outside the window), so code written for `DynamicLayer` runs on it;
    `update` returns past (dequantized) + window + the new states in full precision, as transformers'
    `QuantizedLayer` does. Batch and token moves (reorder, repeat, select, crop, `take_entries`) move codes as they are.
    """

    def __init__(self, config: LoopKVQuantConfig | None = None):
        self.config = config or LoopKVQuantConfig()
        self._q = {"k": None, "v": None}  # quantized past
        self._r = {"k": None, "v": None}  # fp window (the most recent entries)
        super().__init__()

    # -- storage -----------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self._group = self.config.group(key_states.shape[-1])
        self._q = {"k": None, "v": None}
        self._r = {"k": key_states[..., :0, :], "v": value_states[..., :0, :]}
        self.is_initialized = True

    def _read(self, side: str) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        q, r = self._q[side], self._r[side]
        if q is None:
            return r
        return torch.cat([dequantize_kv(q), r], dim=-2) if r.shape[-2] else dequantize_kv(q)

    def _store(self, side: str, states: torch.Tensor | None) -> None:
        """Replace one side by `states`: the last `residual_length` entries stay fp, older ones are quantized."""
        if states is None:  # DynamicLayer.reset
            self._q[side], self._r[side] = None, None
            return
        if not self.is_initialized:
            self.lazy_initialization(states, states)
        n = max(states.shape[-2] - self.config.residual_length, 0)
        self._q[side] = quantize_kv(states[..., :n, :], self.config.nbits, self._group) if n else None
        self._r[side] = states[..., n:, :]

    keys = property(lambda self: self._read("k"), lambda self, x: self._store("k", x))
    values = property(lambda self: self._read("v"), lambda self, x: self._store("v", x))

    def _append(self, side: str, new: torch.Tensor) -> None:
        r = torch.cat([self._r[side], new], dim=-2)
        n = r.shape[-2] - self.config.residual_length
        if n > 0:
            fresh = quantize_kv(r[..., :n, :], self.config.nbits, self._group)
            self._q[side] = QuantizedKV.cat([self._q[side], fresh])
            r = r[..., n:, :]
        self._r[side] = r

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out = []
        for side, new in (("k", key_states), ("v", value_states)):
            past = self._read(side)
            out.append(torch.cat([past, new], dim=-2) if past.shape[-2] else new)
            self._append(side, new)
        return out[0], out[1]

    def _map(self, fn) -> None:
        """Apply a batch/token shape op to every stored tensor."""
        for side in ("k", "v"):
            if self._q[side] is not None:
                self._q[side] = self._q[side].map(fn)
            self._r[side] = fn(self._r[side])

    def _lengths(self) -> tuple[int, int]:
        q = self._q["k"]
        return (0 if q is None else q.length), self._r["k"].shape[-2]

    # -- DynamicLayer interface ----------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        if not self.is_initialized or self._r["k"] is None:
            return 0
        nq, nr = self._lengths()
        return nq + nr

    def batch_size(self) -> int:
        return self._r["k"].shape[0] if self.is_initialized and self._r["k"] is not None else 0

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer's convention: remove the last `-tokens_to_remove` entries (a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized or self._r["k"] is None:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        self.take_entries(torch.arange(keep, device=self.device))

    def take_entries(self, index: torch.Tensor) -> None:
        """Keep the entries `index` along the token dim, in that order (TaH2's ragged streams). Codes move as they are;
        the selected fp window entries that end up behind a quantized one are quantized (once) to keep one layout."""
        nq, nr = self._lengths()
        index = index.to(self.device).long()
        in_window = index >= nq
        # the longest suffix of window entries stays fp
        tail = int(torch.flip(in_window, (0,)).long().cumprod(0).sum()) if index.numel() else 0
        head = index[: index.numel() - tail]
        for side in ("k", "v"):
            r = self._r[side]
            parts = [self._q[side]]
            if nr and head.numel() and bool((head >= nq).any()):
                parts.append(quantize_kv(r, self.config.nbits, self._group))
            allq = QuantizedKV.cat(parts) if parts[0] is not None or len(parts) > 1 else None
            self._q[side] = allq.map(lambda t: t.index_select(-2, head)) if head.numel() else None
            self._r[side] = r.index_select(-2, index[index.numel() - tail:] - nq)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            idx = beam_idx.to(self.device)
            self._map(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._map(lambda t: t[indices, ...])

    def shallow_copy(self) -> QuantizedLoopLayer:
        """A second layer holding the same entries (tensors shared: no operation writes them in place)."""
        twin = QuantizedLoopLayer(self.config)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_q", "_r")})
        twin._q, twin._r = dict(self._q), dict(self._r)
        return twin

    def offload(self):
        if self.is_initialized:
            self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def nbytes(self) -> int:
        """Bytes held: codes + scales (+ zero points) + the fp window, keys and values."""
        if not self.is_initialized or self._r["k"] is None:
            return 0
        total = 0
        for side in ("k", "v"):
            if self._q[side] is not None:
                total += self._q[side].nbytes()
            total += self._r[side].numel() * self._r[side].element_size()
        return total


def cache_kv_bytes(model, cache) -> int:
    """Bytes of the keys and values a model's cache holds: the cache's own count where it keeps one (TaH2), the
    model's (SpiralFormer), else the sum over its layers."""
    if hasattr(cache, "kv_bytes"):
        return cache.kv_bytes()
    if hasattr(model.model, "cache_bytes"):
        return model.model.cache_bytes(cache)["kv"]
    return sum(kv_layer_bytes(layer) for layer in cache.layers)


def kv_layer_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer stores (a quantized layer: what it really holds)."""
    if isinstance(layer, QuantizedLoopLayer) or hasattr(layer, "nbytes"):
        return layer.nbytes()
    if not layer.is_initialized or layer.keys is None or layer.get_seq_length() == 0:
        return 0
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
