"""Loop machinery shared by the hf_loops architectures.

This file ships as Hub remote code next to the modeling files: it imports only torch and transformers.

- Cache slots: a looped model keeps one `DynamicLayer` per (iteration/stream, layer) inside `cache.layers`, so the
  Cache API that `generate` relies on (reorder for beam search, batch repeat/select, crop) keeps working. `generate`
  builds `DynamicCache(config=...)` with exactly `num_hidden_layers` layers; `ensure_cache_slots` extends it in place.
- `LoopCacheView` maps the layer index a shared `Qwen3DecoderLayer` was built with onto the slot of one iteration.
- Masks: float additive masks work for both eager and sdpa (a bool mask is *added* to the scores by eager).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


def ensure_cache_slots(cache: Cache, num_slots: int) -> Cache:
    """Grow `cache.layers` in place to at least `num_slots` dynamic layers.

    Only dynamic caches can hold looped states whose length is not known in advance (sparse deeper streams, chunk
    latents): a static/compileable cache gets a clear error instead of a silently wrong answer.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"hf_loops looped models need a DynamicCache (one growing slot per iteration and layer); got "
            f"{type(cache).__name__}. Use cache_implementation='dynamic' (the default) or pass cache=DynamicCache()."
        )
    while len(cache.layers) < num_slots:
        cache.layers.append(DynamicLayer())
    return cache


class LoopCacheView:
    """Cache proxy handed to shared decoder layers: `layer_idx` → `offset + layer_idx`.

    The shared `Qwen3DecoderLayer`s are built once with their own `layer_idx`; each loop iteration gives them a view
    whose offset selects that iteration's slots, so no module is ever mutated.
    """

    def __init__(self, cache: Cache, offset: int):
        self._cache = cache
        self._offset = offset

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._cache.update(key_states, value_states, layer_idx + self._offset, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._cache.get_seq_length(layer_idx + self._offset)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = may attend) → float additive mask (0 / finfo.min) usable by eager and sdpa."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg)


def plain_attention_mask(attention_mask):
    """`generate` with a compileable cache hands masks in as a dict keyed by layer type; others pass 2-D/4-D tensors."""
    if isinstance(attention_mask, dict):
        return attention_mask.get("full_attention")
    return attention_mask


def positions_from_mask(attention_mask: torch.Tensor | None, past_length: int, query_length: int, device) -> torch.Tensor:
    """RoPE positions of the new tokens: from a 2-D padding mask (left padding) when given, else past + arange."""
    if attention_mask is not None and attention_mask.dim() == 2:
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.clamp(min=0)[:, -query_length:]
    return (torch.arange(query_length, device=device) + past_length).unsqueeze(0)


def sequence_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document id of every token of a packed (padding-free) row: a new document starts wherever position resets to 0."""
    starts = (position_ids == 0).long()
    starts[:, 0] = 1
    return starts.cumsum(-1) - 1
