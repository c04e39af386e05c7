"""TaH2's KV streams: the persistent cache of `generate` and the per-call stream store the shared layers write to.

A token's depth-m states live in KV *stream* m−1. `TaH2Cache` keeps one `DynamicLayer` per (stream, layer) inside
`cache.layers` (plus one metadata layer per stream), so every batch operation `generate` performs moves them together.
`CallStreams` says where each stream lives during one forward call and which keys a mask is built from; `StreamView` is
the `cache=` object the shared decoder layers receive while they run one depth.

This file ships as Hub remote code next to modeling_tah2.py: it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .loop_utils import ensure_cache_slots

__all__ = ["TaH2Cache", "CallStreams", "StreamView"]


# ----------------------------------------------------------------------------------------------------------------------
# Cache: one DynamicLayer per (stream, layer) + one metadata layer per stream
# ----------------------------------------------------------------------------------------------------------------------


class TaH2Cache(DynamicCache):
    """KV cache of TaH2: one `DynamicLayer` per (stream j, layer l) inside `cache.layers`.

    Layout: stream j occupies slots `j*(L+1) .. j*(L+1)+L-1` for its L layers and slot `j*(L+1)+L` for its metadata,
    stored as a `DynamicLayer` too (keys = RoPE position, values = [valid, stream-0 index, executed depth], fp32), so
    that every batch operation `generate` performs on `cache.layers` (beam reorder, repeat, select) moves metadata
    and K/V together. Stream 0 is dense (every token); deeper streams hold only tokens that ran that depth, rows
    right-padded with valid = 0. `get_seq_length()` reads stream 0 layer 0, i.e. counts tokens.

    `generate` builds a plain `DynamicCache(config=...)`; the model adopts it in place (`TaH2Cache.adopt`), which adds
    the slots and gives it this class's `crop`.
    """

    num_backbone_layers: int = 0

    @classmethod
    def adopt(cls, cache: Cache, num_backbone_layers: int) -> "TaH2Cache":
        if not isinstance(cache, DynamicCache):
            raise ValueError(
                f"TaH2 needs a DynamicCache (its deeper streams grow by a data-dependent number of tokens); got "
                f"{type(cache).__name__}. Use the default dynamic cache in generate."
            )
        if not isinstance(cache, TaH2Cache):
            # Same state, TaH2's crop/metadata methods: the object generate holds keeps working in place.
            cache.__class__ = TaH2Cache
        if cache.num_backbone_layers not in (0, num_backbone_layers):
            raise ValueError(
                f"cache was built for {cache.num_backbone_layers} layers, the model has {num_backbone_layers}"
            )
        cache.num_backbone_layers = num_backbone_layers
        ensure_cache_slots(cache, num_backbone_layers + 1)
        return cache

    # -- layout ------------------------------------------------------------------------------------------------------
    def kv_slot(self, stream: int, layer_idx: int) -> int:
        return stream * (self.num_backbone_layers + 1) + layer_idx

    def meta_slot(self, stream: int) -> int:
        return stream * (self.num_backbone_layers + 1) + self.num_backbone_layers

    def ensure_streams(self, num_streams: int) -> None:
        ensure_cache_slots(self, num_streams * (self.num_backbone_layers + 1))

    @property
    def num_streams(self) -> int:
        n = 0
        while self.meta_slot(n) < len(self.layers) and self.layers[self.meta_slot(n)].get_seq_length() > 0:
            n += 1
        return n

    def kv_layer(self, stream: int, layer_idx: int) -> DynamicLayer:
        self.ensure_streams(stream + 1)
        return self.layers[self.kv_slot(stream, layer_idx)]

    # -- metadata ----------------------------------------------------------------------------------------------------
    def stream_metadata(self, stream: int) -> dict | None:
        """pos, valid, index (stream-0 coordinate) and depth of every entry of `stream`, or None when empty."""
        slot = self.meta_slot(stream)
        if slot >= len(self.layers) or self.layers[slot].get_seq_length() == 0:
            return None
        layer = self.layers[slot]
        pos = layer.keys[:, 0, :, 0].long()
        extra = layer.values[:, 0]
        return {"pos": pos, "valid": extra[..., 0] > 0.5, "index": extra[..., 1].long(), "depth": extra[..., 2].long()}

    def append_metadata(self, stream: int, pos, valid, index, depth) -> None:
        self.ensure_streams(stream + 1)
        keys = pos.to(torch.float32)[:, None, :, None]
        values = torch.stack([valid.to(torch.float32), index.to(torch.float32), depth.to(torch.float32)], dim=-1)
        self.layers[self.meta_slot(stream)].update(keys, values[:, None])

    @property
    def token_depth(self) -> torch.Tensor | None:
        """(B, S) executed depth of every cached token (0 for padding)."""
        meta = self.stream_metadata(0)
        return None if meta is None else meta["depth"] * meta["valid"]

    # -- generate's cache operations -------------------------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (v5 convention: a negative count).

        Stream 0 is cut like any dynamic cache. A deeper stream's entries of removed tokens are marked invalid, then the
        trailing columns that no row still uses are dropped.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.get_seq_length() == 0:
            return
        keep_tokens = self.get_seq_length() + tokens_to_remove
        for stream in range(self.num_streams):
            slots = [self.kv_slot(stream, l) for l in range(self.num_backbone_layers)] + [self.meta_slot(stream)]
            if stream == 0:
                for s in slots:
                    self.layers[s].crop(tokens_to_remove)
                continue
            meta_layer = self.layers[self.meta_slot(stream)]
            index = meta_layer.values[:, 0, :, 1]
            gone = index >= keep_tokens
            meta_layer.values = meta_layer.values.clone()
            meta_layer.values[:, 0, :, 0] = torch.where(gone, 0.0, meta_layer.values[:, 0, :, 0])
            still = meta_layer.values[:, 0, :, 0] > 0.5
            used = still.any(0).nonzero()
            width = int(used.max()) + 1 if used.numel() else 0
            for s in slots:
                layer = self.layers[s]
                if width == 0:
                    layer.reset()
                else:
                    layer.keys = layer.keys[..., :width, :]
                    layer.values = layer.values[..., :width, :]


# ----------------------------------------------------------------------------------------------------------------------
# Per-call stream store and the view handed to the shared decoder layers
# ----------------------------------------------------------------------------------------------------------------------


class CallStreams:
    """Where each stream's K/V live during one forward call, and the key metadata the masks are built from.

    Stream j is written to the persistent cache when there is one (in causal mode only stream 0: deeper states of
    earlier tokens are never visible, so they are dropped after the call) and otherwise to a scratch cache that lives
    for this call only. Training therefore carries cross-iteration K/V explicitly, never through HF's `cache=` path.
    """

    def __init__(self, cache: TaH2Cache | None, num_layers: int, persist_deeper: bool):
        self.cache = cache
        self.num_layers = num_layers
        self.persist_deeper = persist_deeper
        self.scratch: TaH2Cache | None = None
        self.meta: dict[int, dict] = {}  # stream -> past + new metadata (full batch)
        self.new_meta: dict[int, dict] = {}  # stream -> this call's entries
        self.had_past: dict[int, bool] = {}  # set by `commit`: did the stream hold entries before this call?

    def store(self, stream: int) -> TaH2Cache:
        if self.cache is not None and (stream == 0 or self.persist_deeper):
            return self.cache
        if self.scratch is None:
            self.scratch = TaH2Cache.adopt(DynamicCache(), self.num_layers)
        return self.scratch

    def add_entries(self, stream: int, pos, valid, index, seq=None, cont=None) -> None:
        """Register this call's new entries of `stream` (full batch, appended after the past entries).

        `cont` (lookahead only) marks entries whose token really executed this depth in the main forward."""
        self.new_meta[stream] = {"pos": pos, "valid": valid, "index": index, "seq": seq, "cont": cont}
        self.meta.pop(stream, None)  # merged with the past lazily: most decode steps never read it

    def merged(self, stream: int) -> dict:
        """Past + this call's metadata of `stream` (full batch)."""
        if stream not in self.meta:
            new = self.new_meta[stream]
            if stream in self.had_past:  # committed: the store already holds past + new
                past = self.store(stream).stream_metadata(stream) if self.had_past[stream] else None
                if past is not None:
                    self.meta[stream] = {**past, "seq": None, "cont": None}
                    return self.meta[stream]
            else:
                past = self.store(stream).stream_metadata(stream)
            if past is None:
                self.meta[stream] = new
            else:
                merged = {k: torch.cat([past[k], new[k]], dim=1) for k in ("pos", "valid", "index")}
                merged["seq"] = merged["cont"] = None
                self.meta[stream] = merged
        return self.meta[stream]

    def has(self, stream: int) -> bool:
        return stream in self.meta or stream in self.new_meta

    def share_streams(self, other: "CallStreams", streams: list[int]) -> None:
        """Read-only access to `other`'s streams (the lookahead reads the main forward's K/V without copying)."""
        if self.scratch is None:
            self.scratch = TaH2Cache.adopt(DynamicCache(), self.num_layers)
        self.scratch.ensure_streams(max(streams) + 1)
        for s in streams:
            src = other.store(s)
            for offset in range(self.num_layers + 1):
                self.scratch.layers[self.scratch.kv_slot(s, 0) + offset] = src.layers[src.kv_slot(s, 0) + offset]
            self.meta[s] = other.merged(s)

    def past_metadata(self, stream: int) -> dict | None:
        return self.store(stream).stream_metadata(stream)

    def key_metadata(self, streams: list[int], rows: torch.Tensor | None) -> dict:
        streams = [s for s in streams if self.has(s)]
        parts = [self.merged(s) for s in streams]
        out = {
            "pos": torch.cat([p["pos"] for p in parts], 1),
            "valid": torch.cat([p["valid"] for p in parts], 1),
            "iter": torch.cat([torch.full_like(p["pos"], s) for s, p in zip(streams, parts)], 1),
        }
        out["seq"] = (
            torch.cat([p["seq"] for p in parts], 1) if all(p["seq"] is not None for p in parts) else None
        )
        out["cont"] = torch.cat(
            [p["cont"] if p.get("cont") is not None else torch.zeros_like(p["valid"]) for p in parts], 1
        )
        if rows is not None:
            out = {k: (v.index_select(0, rows) if v is not None else None) for k, v in out.items()}
        return out

    def commit(self, depth_of_new_stream0: torch.Tensor) -> None:
        """Append this call's metadata to the caches that keep it (K/V were appended by the layers)."""
        for stream, new in self.new_meta.items():
            store = self.store(stream)
            # After this append `store` holds past + new; `merged` must not add `new` a second time (the lookahead
            # reads these streams after the main forward has committed them).
            slot = store.meta_slot(stream)
            self.had_past[stream] = slot < len(store.layers) and store.layers[slot].get_seq_length() > 0
            depth = depth_of_new_stream0 if stream == 0 else torch.zeros_like(new["pos"])
            store.append_metadata(stream, new["pos"], new["valid"], new["index"], depth)


class StreamView:
    """`cache=` object for the shared layers while they run stream `stream` on the rows `rows` of the batch.

    `update` writes the rows' new K/V into the stream's slot (full batch: rows that are not running get zero
    placeholders, which the metadata marks invalid) and returns, for those rows, the keys of every stream the mode
    lets this depth see, concatenated in stream order — the same order as `CallStreams.key_metadata`.

    Under activation checkpointing a layer runs twice; the second (recompute) call rebuilds the same concatenation
    from the prefix that preceded this call's write instead of writing again.

    `copy_previous` (B, T) bool, dense streams only (every token in every stream, in time order): those tokens' new
    K/V are replaced by their K/V in the previous stream (Ouro-style `exit_kv_fill="copy_last"`: a token that exited
    exposes its last executed states at every deeper depth).
    """

    def __init__(self, streams: CallStreams, stream: int, key_streams: list[int], rows, batch_size: int,
                 copy_previous: torch.Tensor | None = None):
        self.streams = streams
        self.stream = stream
        self.key_streams = key_streams
        self.rows = rows
        self.batch_size = batch_size
        self.copy_previous = copy_previous
        self._prefix_len: dict[int, int] = {}

    def _copy_from_previous_stream(self, key_states, value_states, layer_idx):
        prev = self.streams.store(self.stream - 1).kv_layer(self.stream - 1, layer_idx)
        T = key_states.shape[-2]
        take = self.copy_previous[:, None, :, None]
        return (torch.where(take, prev.keys[..., -T:, :], key_states),
                torch.where(take, prev.values[..., -T:, :], value_states))

    def _scatter(self, states: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return states
        full = states.new_zeros((self.batch_size,) + tuple(states.shape[1:]))
        return full.index_copy(0, self.rows, states)

    def _select(self, states: torch.Tensor) -> torch.Tensor:
        return states if self.rows is None else states.index_select(0, self.rows)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        store = self.streams.store(self.stream)
        layer = store.kv_layer(self.stream, layer_idx)
        k_new, v_new = self._scatter(key_states), self._scatter(value_states)
        if self.copy_previous is not None:
            k_new, v_new = self._copy_from_previous_stream(k_new, v_new, layer_idx)
        if layer_idx not in self._prefix_len:
            self._prefix_len[layer_idx] = layer.get_seq_length()
            k_all, v_all = layer.update(k_new, v_new)
        else:
            n = self._prefix_len[layer_idx]
            k_all = torch.cat([layer.keys[..., :n, :], k_new], dim=-2)
            v_all = torch.cat([layer.values[..., :n, :], v_new], dim=-2)
        keys, values = [], []
        for s in self.key_streams:
            if s == self.stream:
                keys.append(k_all)
                values.append(v_all)
            elif self.streams.has(s):
                other = self.streams.store(s).kv_layer(s, layer_idx)
                keys.append(other.keys)
                values.append(other.values)
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-2)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=-2)
        return self._select(k), self._select(v)
