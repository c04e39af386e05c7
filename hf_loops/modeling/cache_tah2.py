"""TaH2's KV streams: the persistent cache of `generate` and the per-call stream store the shared layers write to.

A token's depth-m states live in KV *stream* m−1. `TaH2Cache` keeps one `DynamicLayer` per (stream, layer) inside
`cache.layers` (plus one metadata layer per stream), so every batch operation `generate` performs moves them together.
`CallStreams` says where each stream lives during one forward call and which keys a mask is built from; `StreamView` is
the `cache=` object the shared decoder layers receive while they run one depth.

Two layouts:
- *padded*: (B, H, S, D) per layer, rows right-padded with invalid entries. Stream 0 (every token) always; deeper
  streams of the per-call scratch store (training, lookahead) and of dense-stream variants (Ouro exit gate).
- *ragged*: the deeper streams of the persistent cache of an adaptive model. Only real entries are stored, flat, in
  arrival order: K/V as (1, H, N, D) and metadata rows [row, stream-0 index, depth, document]. Attention reads a
  row-padded view gathered per call (`RaggedLayout`), so the stored bytes are exactly Σ_t (depth executed by t) K/V
  entries — the cache holds a token's deeper states only for the depths it ran, at any batch size.

This file ships as Hub remote code next to modeling_tah2.py: it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .configuration_tah2 import ITERATION_ATTENTION_MODES
from .kv_quant import QuantizedLoopLayer, kv_layer_bytes
from .loop_utils import ensure_cache_slots

__all__ = ["TaH2Cache", "CallStreams", "StreamView", "RaggedLayout", "flat_sequence_ids"]


def flat_sequence_ids(seq: torch.Tensor | None, batch_size: int, width: int, device) -> torch.Tensor:
    """(B, T) sequence id of every token once the rows are laid end to end (flat packing): row b's document j gets
    b·(T + 1) + j, so no two rows (and no two documents of a packed row) share an id."""
    rows = torch.arange(batch_size, device=device)[:, None] * (width + 1)
    return (rows + (seq if seq is not None else torch.zeros((), dtype=torch.long, device=device))).expand(batch_size, width)


def flatten_rows(t: torch.Tensor) -> torch.Tensor:
    """Row-padded (B, S, ...) metadata → (1, B·S, ...), row-major (the flat packing's key order)."""
    return t.reshape(1, -1, *t.shape[2:])


def flatten_rows_kv(t: torch.Tensor) -> torch.Tensor:
    """Row-padded (B, H, S, D) keys or values → (1, H, B·S, D), row-major over (row, slot)."""
    B, H, S, D = t.shape
    return t.transpose(0, 1).reshape(1, H, B * S, D)


# ----------------------------------------------------------------------------------------------------------------------
# Ragged layout: flat entries → a row-padded view
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class RaggedLayout:
    """Row-padded view of a ragged stream: `gather` (B, n) holds each row's flat entry indices in arrival order
    (−1 past the row's count), n = the largest row count. Metadata fields are (B, n), invalid slots zero."""

    gather: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    index: torch.Tensor
    depth: torch.Tensor
    seq: torch.Tensor

    @classmethod
    def build(cls, meta_keys: torch.Tensor, meta_values: torch.Tensor, counts: list[int]) -> RaggedLayout:
        """`counts`: entries per row, kept on the host by the cache, so the view's width needs no device read."""
        rows = meta_values[0, 0, :, 0].long()
        N, device = rows.numel(), rows.device
        batch_size, width = len(counts), max(counts, default=0)
        counts = torch.tensor(counts, dtype=torch.long, device=device)
        order = torch.argsort(rows, stable=True)
        sorted_rows = rows[order]
        start = counts.cumsum(0) - counts
        slot = torch.arange(N, device=device) - start[sorted_rows]
        gather = torch.full((batch_size, width), -1, dtype=torch.long, device=device)
        gather[sorted_rows, slot] = order
        valid = gather >= 0
        safe = gather.clamp(min=0)

        def field(flat):
            return torch.where(valid, flat[safe], torch.zeros((), dtype=flat.dtype, device=device))

        extra = meta_values[0, 0]
        return cls(gather, valid, field(meta_keys[0, 0, :, 0].long()), field(extra[:, 1].long()),
                   field(extra[:, 2].long()), field(extra[:, 3].long()))

    def rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        return self.gather if rows is None else self.gather.index_select(0, rows)

    @staticmethod
    def read(flat: torch.Tensor | None, gather: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(1, H, N, D) flat states → (Bj, H, n, D) for the rows of `gather` (invalid slots hold entry 0); `like`
        gives H, D and dtype when the stream stores nothing yet."""
        Bj, n = gather.shape
        if flat is None or flat.numel() == 0:
            return like.new_zeros((Bj, like.shape[1], n, like.shape[-1]))
        picked = flat[0].index_select(1, gather.clamp(min=0).reshape(-1))  # (H, Bj·n, D)
        return picked.view(picked.shape[0], Bj, n, picked.shape[-1]).transpose(0, 1)


def _flat_real(states: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """(Bj, H, Tj, D) states of the slots `real` (Bj, Tj) → (1, H, n, D), row-major (the order metadata is flattened);
    `real=None`: every slot (one-token calls), without a boolean index."""
    flat = states.transpose(1, 2)
    flat = flat.reshape(-1, *flat.shape[2:]) if real is None else flat[real]
    return flat.transpose(0, 1).unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------------------
# Cache: one DynamicLayer per (stream, layer) + one metadata layer per stream
# ----------------------------------------------------------------------------------------------------------------------


class TaH2Cache(DynamicCache):
    """KV cache of TaH2: one `DynamicLayer` per (stream j, layer l) inside `cache.layers`.

    Layout: stream j occupies slots `j*(L+1) .. j*(L+1)+L-1` for its L layers and slot `j*(L+1)+L` for its metadata,
    stored as a `DynamicLayer` too (fp32). Stream 0 is dense (every token): metadata keys = RoPE position, values =
    [valid, stream-0 index, executed depth]. With `ragged_streams` (adaptive models) deeper streams hold only the
    tokens that ran that depth, flat: K/V (1, H, N, D), metadata keys = position, values = [row, index, 0, document].
    Otherwise deeper streams are row-padded like stream 0 (valid = 0 marks padding). `get_seq_length()` reads stream 0
    layer 0, i.e. counts tokens. Beam reorder, batch repeat/select and crop move every stream together.

    `generate` builds a plain `DynamicCache(config=...)`; the model adopts it in place (`TaH2Cache.adopt`), which adds
    the slots and gives it this class's methods.
    """

    num_backbone_layers: int = 0
    ragged_streams: bool = False

    @classmethod
    def adopt(cls, cache: Cache, num_backbone_layers: int, ragged_streams: bool = False) -> TaH2Cache:
        if not isinstance(cache, DynamicCache):
            raise ValueError(
                f"TaH2 needs a DynamicCache (its deeper streams grow by a data-dependent number of tokens); got "
                f"{type(cache).__name__}. Use the default dynamic cache in generate."
            )
        fresh = not isinstance(cache, TaH2Cache) or cache.num_backbone_layers == 0
        if not isinstance(cache, TaH2Cache):
            # Same state, TaH2's crop/metadata methods: the object generate holds keeps working in place.
            cache.__class__ = TaH2Cache
        if cache.num_backbone_layers not in (0, num_backbone_layers):
            raise ValueError(
                f"cache was built for {cache.num_backbone_layers} layers, the model has {num_backbone_layers}"
            )
        if fresh or cache.get_seq_length() == 0:
            cache.ragged_streams = ragged_streams
        elif cache.ragged_streams != ragged_streams:
            raise ValueError("this cache was filled by a model with a different deeper-stream layout (ragged vs padded)")
        cache.num_backbone_layers = num_backbone_layers
        ensure_cache_slots(cache, num_backbone_layers + 1)
        return cache

    # -- layout ------------------------------------------------------------------------------------------------------
    def is_kv_slot(self, index: int) -> bool:
        """Slot `index` holds keys/values (not a stream's metadata): what a quantized loop cache quantizes."""
        return self.num_backbone_layers == 0 or index % (self.num_backbone_layers + 1) != self.num_backbone_layers

    def kv_slot(self, stream: int, layer_idx: int) -> int:
        return stream * (self.num_backbone_layers + 1) + layer_idx

    def meta_slot(self, stream: int) -> int:
        return stream * (self.num_backbone_layers + 1) + self.num_backbone_layers

    def ensure_streams(self, num_streams: int) -> None:
        ensure_cache_slots(self, num_streams * (self.num_backbone_layers + 1))

    def is_ragged(self, stream: int) -> bool:
        return self.ragged_streams and stream > 0

    @property
    def num_streams(self) -> int:
        n = 0
        while self.meta_slot(n) < len(self.layers) and self.layers[self.meta_slot(n)].get_seq_length() > 0:
            n += 1
        return n

    def kv_layer(self, stream: int, layer_idx: int) -> DynamicLayer:
        self.ensure_streams(stream + 1)
        return self.layers[self.kv_slot(stream, layer_idx)]

    def stream_slots(self, stream: int) -> list[int]:
        return [self.kv_slot(stream, l) for l in range(self.num_backbone_layers)] + [self.meta_slot(stream)]

    def batch_size(self) -> int:
        if self.get_seq_length() == 0:
            return 0
        layer = self.layers[0]
        return layer.batch_size() if isinstance(layer, QuantizedLoopLayer) else layer.keys.shape[0]

    def kv_bytes(self) -> int:
        """Bytes of stored keys and values (metadata excluded; a quantized loop cache: codes, scales and fp window)."""
        total = 0
        for stream in range(self.num_streams):
            for slot in self.stream_slots(stream)[:-1]:
                layer = self.layers[slot]
                if layer.get_seq_length() > 0:
                    total += kv_layer_bytes(layer)
        return total

    # -- metadata ----------------------------------------------------------------------------------------------------
    def _row_counts(self, stream: int, batch_size: int) -> list[int]:
        """Entries per row of ragged stream `stream`, kept on the host (appends update it from host-known rows; a
        crop or batch reorder drops it and the next read recounts once)."""
        counts = self.__dict__.setdefault("_ragged_counts", {})
        if stream not in counts or len(counts[stream]) != batch_size:
            layer = self.layers[self.meta_slot(stream)]
            rows = layer.values[0, 0, :, 0].long() if layer.get_seq_length() > 0 else torch.zeros(0, dtype=torch.long)
            counts[stream] = torch.bincount(rows, minlength=batch_size).tolist()
        return counts[stream]

    def ragged_layout(self, stream: int, batch_size: int | None = None) -> RaggedLayout | None:
        slot = self.meta_slot(stream)
        if slot >= len(self.layers) or self.layers[slot].get_seq_length() == 0:
            return None
        layer = self.layers[slot]
        batch_size = batch_size or self.batch_size()
        return RaggedLayout.build(layer.keys, layer.values, self._row_counts(stream, batch_size))

    def stream_metadata(self, stream: int, batch_size: int | None = None) -> dict | None:
        """pos, valid, index (stream-0 coordinate) and depth of every entry of `stream`, row-padded (B, n); None when
        empty. A ragged stream also returns `gather`, its entries' flat indices."""
        if self.is_ragged(stream):
            lay = self.ragged_layout(stream, batch_size)
            if lay is None:
                return None
            return {"pos": lay.pos, "valid": lay.valid, "index": lay.index, "depth": lay.depth, "seq": lay.seq,
                    "gather": lay.gather}
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

    def append_ragged_metadata(self, stream: int, pos, valid, index, seq=None, rows_hint=None) -> None:
        """Append the real entries (`valid`) of (B, T) metadata to ragged stream `stream`, row-major. `rows_hint` =
        (device rows, host rows) of a one-token call: the entries are (row, 0) for those rows, found without a sync."""
        self.ensure_streams(stream + 1)
        counts = self._row_counts(stream, valid.shape[0])
        if rows_hint is not None:
            rows, host_rows = rows_hint
            t = torch.zeros_like(rows)
            for r in host_rows:
                counts[r] += 1
        else:
            rows, t = valid.nonzero(as_tuple=True)
            for r, n in enumerate(valid.sum(1).tolist()):
                counts[r] += n
        doc = seq[rows, t] if seq is not None else torch.full_like(rows, -1)
        values = torch.stack([rows, index[rows, t], torch.zeros_like(rows), doc], dim=-1).to(torch.float32)
        keys = pos[rows, t].to(torch.float32)
        self.layers[self.meta_slot(stream)].update(keys[None, None, :, None], values[None, None])

    @property
    def token_depth(self) -> torch.Tensor | None:
        """(B, S) executed depth of every cached token (0 for padding)."""
        meta = self.stream_metadata(0)
        return None if meta is None else meta["depth"] * meta["valid"]

    # -- generate's cache operations -------------------------------------------------------------------------------------
    def _keep_entries(self, stream: int, entries: torch.Tensor, new_rows: torch.Tensor | None = None) -> None:
        """Ragged stream: keep the flat `entries` (in this order); `new_rows` relabels their rows."""
        self.__dict__.get("_ragged_counts", {}).pop(stream, None)
        for slot in self.stream_slots(stream):
            layer = self.layers[slot]
            if entries.numel() == 0:
                layer.reset()
                continue
            if isinstance(layer, QuantizedLoopLayer):  # codes move as they are
                layer.take_entries(entries)
                continue
            layer.keys = layer.keys.index_select(2, entries)
            layer.values = layer.values.index_select(2, entries)
        if new_rows is not None and entries.numel():
            meta = self.layers[self.meta_slot(stream)]
            meta.values = meta.values.clone()
            meta.values[0, 0, :, 0] = new_rows.to(meta.values.dtype)

    def _select_rows(self, rows: torch.Tensor) -> None:
        """New batch row r = old row `rows[r]` (beam reorder, repeat, select): dense slots by index_select, ragged
        streams by taking each selected row's entries in order."""
        for stream in range(self.num_streams):
            if not self.is_ragged(stream):
                for slot in self.stream_slots(stream):
                    self.layers[slot].reorder_cache(rows)
                continue
            old_rows = self.layers[self.meta_slot(stream)].values[0, 0, :, 0].long()
            new_row, entries = (old_rows[None, :] == rows.to(old_rows.device)[:, None]).nonzero(as_tuple=True)
            self._keep_entries(stream, entries, new_row)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        B = self.batch_size()
        if B:
            self._select_rows(torch.arange(B, device=self.layers[0].device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.batch_size():
            indices = torch.as_tensor(indices, device=self.layers[0].device)
            self._select_rows(indices.nonzero().squeeze(1) if indices.dtype == torch.bool else indices.long())

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (v5 convention: a negative count).

        Stream 0 is cut like any dynamic cache. A deeper stream loses the entries of removed tokens: ragged streams drop
        them; padded streams mark them invalid, then drop the trailing columns that no row still uses.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.get_seq_length() == 0:
            return
        keep_tokens = self.get_seq_length() + tokens_to_remove
        for stream in range(self.num_streams):
            slots = self.stream_slots(stream)
            meta_layer = self.layers[self.meta_slot(stream)]
            if stream == 0:
                for s in slots:
                    self.layers[s].crop(tokens_to_remove)
            elif self.is_ragged(stream):
                self._keep_entries(stream, (meta_layer.values[0, 0, :, 1] < keep_tokens).nonzero().squeeze(1))
            else:
                self._crop_padded(slots, meta_layer, keep_tokens)

    def _crop_padded(self, slots, meta_layer, keep_tokens: int) -> None:
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
            elif isinstance(layer, QuantizedLoopLayer):
                layer.crop(width - layer.get_seq_length())
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

    A ragged stream (deeper stream of a persistent ragged cache) gets this call's metadata appended at once
    (`add_entries`); its row-padded view is built once per call and shared by every layer (`layout`).
    """

    def __init__(self, cache: TaH2Cache | None, num_layers: int, persist_deeper: bool, batch_size: int = 0):
        self.cache = cache
        self.num_layers = num_layers
        self.persist_deeper = persist_deeper
        self.batch_size = batch_size
        self.scratch: TaH2Cache | None = None
        self.meta: dict[int, dict] = {}  # stream -> past + new metadata (full batch)
        self.new_meta: dict[int, dict] = {}  # stream -> this call's entries
        self.had_past: dict[int, bool] = {}  # set by `commit`: did the stream hold entries before this call?
        self.layouts: dict[int, RaggedLayout] = {}
        self.flat = False  # deeper streams hold flat (1, N) entries of a flat packing (stream 0 stays row-padded)

    def store(self, stream: int) -> TaH2Cache:
        if self.cache is not None and (stream == 0 or self.persist_deeper):
            return self.cache
        if self.scratch is None:
            self.scratch = TaH2Cache.adopt(DynamicCache(), self.num_layers)
        return self.scratch

    def ragged(self, stream: int) -> bool:
        return self.store(stream).is_ragged(stream)

    def layout(self, stream: int) -> RaggedLayout:
        if stream not in self.layouts:
            self.layouts[stream] = self.store(stream).ragged_layout(stream, self.batch_size)
        return self.layouts[stream]

    def add_entries(self, stream: int, pos, valid, index, seq=None, cont=None, rows_hint=None) -> None:
        """Register this call's new entries of `stream` (full batch, appended after the past entries).

        `cont` (lookahead only) marks entries whose token really executed this depth in the main forward; `rows_hint`
        (one-token calls) = (device rows, host rows) of the entries."""
        self.new_meta[stream] = {"pos": pos, "valid": valid, "index": index, "seq": seq, "cont": cont}
        self.meta.pop(stream, None)  # merged with the past lazily: most decode steps never read it
        if self.ragged(stream):
            self.store(stream).append_ragged_metadata(stream, pos, valid, index, seq, rows_hint)
            self.layouts.pop(stream, None)

    def merged(self, stream: int) -> dict:
        """Past + this call's metadata of `stream` (full batch, row-padded)."""
        if stream not in self.meta:
            if self.ragged(stream):
                lay = self.layout(stream)
                seq = lay.seq if self.new_meta.get(stream, {}).get("seq") is not None else None
                self.meta[stream] = {"pos": lay.pos, "valid": lay.valid, "index": lay.index, "seq": seq, "cont": None}
                return self.meta[stream]
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

    def share_streams(self, other: CallStreams, streams: list[int]) -> None:
        """Read-only access to `other`'s streams (the lookahead reads the main forward's K/V without copying; a ragged
        stream is read through its row-padded view)."""
        if self.scratch is None:
            self.scratch = TaH2Cache.adopt(DynamicCache(), self.num_layers)
        self.scratch.ensure_streams(max(streams) + 1)
        for s in streams:
            src = other.store(s)
            for offset in range(self.num_layers + 1):
                dst = self.scratch.kv_slot(s, 0) + offset
                if other.ragged(s):
                    layer = DynamicLayer()
                    if offset < self.num_layers:
                        flat = src.layers[src.kv_slot(s, offset)]
                        like = src.layers[src.kv_slot(0, offset)].keys
                        gather = other.layout(s).gather
                        layer.update(RaggedLayout.read(flat.keys, gather, like),
                                     RaggedLayout.read(flat.values, gather, like))
                    self.scratch.layers[dst] = layer
                else:
                    self.scratch.layers[dst] = src.layers[src.kv_slot(s, 0) + offset]
            self.meta[s] = other.merged(s)

    def key_metadata(self, streams: list[int], rows: torch.Tensor | None, flat: bool = False) -> dict:
        """Key metadata of `streams` in stream order, for the rows `rows`; `flat`: for a flat query packing, whose
        deeper streams are flat already and whose stream 0 is laid out flat here (with its rows' sequence ids)."""
        streams = [s for s in streams if self.has(s)]
        parts = [self.merged(s) for s in streams]
        if flat:
            parts = [self._flat_part(p) if s == 0 else p for s, p in zip(streams, parts, strict=False)]
        out = {
            "pos": torch.cat([p["pos"] for p in parts], 1),
            "valid": torch.cat([p["valid"] for p in parts], 1),
            "iter": torch.cat([torch.full_like(p["pos"], s) for s, p in zip(streams, parts, strict=False)], 1),
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

    @staticmethod
    def _flat_part(part: dict) -> dict:
        B, S = part["pos"].shape
        seq = flat_sequence_ids(part["seq"], B, S, part["pos"].device)
        return {"pos": flatten_rows(part["pos"]), "valid": flatten_rows(part["valid"]), "index": flatten_rows(part["index"]),
                "seq": flatten_rows(seq), "cont": None if part.get("cont") is None else flatten_rows(part["cont"])}

    def commit(self, depth_of_new_stream0: torch.Tensor) -> None:
        """Append this call's metadata to the caches that keep it (K/V were appended by the layers; ragged streams'
        metadata was appended by `add_entries`)."""
        for stream, new in self.new_meta.items():
            if self.ragged(stream):
                continue
            store = self.store(stream)
            # After this append `store` holds past + new; `merged` must not add `new` a second time (the lookahead
            # reads these streams after the main forward has committed them).
            slot = store.meta_slot(stream)
            self.had_past[stream] = slot < len(store.layers) and store.layers[slot].get_seq_length() > 0
            depth = depth_of_new_stream0 if stream == 0 else torch.zeros_like(new["pos"])
            store.append_metadata(stream, new["pos"], new["valid"], new["index"], depth)


class StreamView:
    """`cache=` object for the shared layers while they run stream `stream` on the rows `rows` of the batch.

    `update` writes the rows' new K/V into the stream's slot and returns, for those rows, the keys of every stream the
    mode lets this depth see, concatenated in stream order — the same order as `CallStreams.key_metadata`. A padded
    stream gets the full batch (rows that are not running get zero placeholders, which the metadata marks invalid); a
    ragged stream gets only the real slots (`real`, (Bj, Tj)) and is read through the call's row-padded view.

    Under activation checkpointing a layer runs twice; the second (recompute) call rebuilds the same concatenation
    from the prefix that preceded this call's write instead of writing again. `checkpointed` runs a layer call under
    a checkpoint function with the stream K/V it reads as explicit inputs and the K/V it writes as explicit outputs:
    reentrant checkpointing runs its forward without autograd and only differentiates through its inputs and outputs,
    so K/V that reached deeper depths through the store alone would carry no gradient back to the depth that wrote them.

    `copy_previous` (B, T) bool, dense streams only (every token in every stream, in time order): those tokens' new
    K/V are replaced by their K/V in the previous stream (Ouro-style `exit_kv_fill="copy_last"`: a token that exited
    exposes its last executed states at every deeper depth).
    """

    def __init__(self, streams: CallStreams, stream: int, key_streams: list[int], rows, batch_size: int,
                 copy_previous: torch.Tensor | None = None, real: torch.Tensor | None = None, flat: bool = False):
        self.streams = streams
        self.flat = flat  # flat query packing: stream 0's row-padded K/V are read laid end to end
        self.stream = stream
        self.key_streams = key_streams
        self.rows = rows
        self.batch_size = batch_size
        self.copy_previous = copy_previous
        self.real = real
        self._prefix_len: dict[int, int] = {}
        self._inputs: dict[int, dict] = {}  # layer_idx -> {stream: (keys, values)} while `checkpointed` runs it
        self._appended: dict[int, tuple] = {}  # layer_idx -> the K/V its last call appended

    def _stored(self, stream: int, layer_idx: int) -> tuple:
        """(keys, values) of `stream` at `layer_idx` as this call reads them: the checkpoint's explicit inputs when the
        layer runs under `checkpointed`, else the store's tensors (None when the stream holds nothing)."""
        given = self._inputs.get(layer_idx)
        if given is not None and stream in given:
            return given[stream]
        if given is not None and stream == self.stream:  # empty before this call: the prefix is nothing
            return None, None
        layer = self.streams.store(stream).kv_layer(stream, layer_idx)
        return layer.keys, layer.values

    def _copy_from_previous_stream(self, key_states, value_states, layer_idx):
        prev_keys, prev_values = self._stored(self.stream - 1, layer_idx)
        T = key_states.shape[-2]
        take = self.copy_previous[:, None, :, None]
        return (torch.where(take, prev_keys[..., -T:, :], key_states),
                torch.where(take, prev_values[..., -T:, :], value_states))

    def _scatter(self, states: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return states
        full = states.new_zeros((self.batch_size,) + tuple(states.shape[1:]))
        return full.index_copy(0, self.rows, states)

    def _select(self, states: torch.Tensor) -> torch.Tensor:
        return states if self.rows is None else states.index_select(0, self.rows)

    def _write(self, key_states, value_states, layer_idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's K/V of the running stream; full-batch padded states of the stream (padded layout).
        The appended tensors are also kept in `_appended` (the outputs of a `checkpointed` call)."""
        layer = self.streams.store(self.stream).kv_layer(self.stream, layer_idx)
        first = layer_idx not in self._prefix_len
        if first:
            self._prefix_len[layer_idx] = layer.get_seq_length()
        if self.streams.ragged(self.stream):
            k_new, v_new = _flat_real(key_states, self.real), _flat_real(value_states, self.real)
            self._appended[layer_idx] = (k_new, v_new)
            if first:
                layer.update(k_new, v_new)
            return None, None
        k_new, v_new = self._scatter(key_states), self._scatter(value_states)
        if self.copy_previous is not None:
            k_new, v_new = self._copy_from_previous_stream(k_new, v_new, layer_idx)
        self._appended[layer_idx] = (k_new, v_new)
        if first and layer_idx not in self._inputs:
            return layer.update(k_new, v_new)
        if first:
            layer.update(k_new, v_new)
        return self._own_stream(layer_idx, k_new, v_new)

    def _own_stream(self, layer_idx, k_new, v_new) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix (the entries before this call's write) + this call's new entries of the running stream."""
        n = self._prefix_len[layer_idx]
        if layer_idx in self._inputs:
            k_old, v_old = self._stored(self.stream, layer_idx)
        else:
            layer = self.streams.store(self.stream).kv_layer(self.stream, layer_idx)
            k_old, v_old = layer.keys[..., :n, :], layer.values[..., :n, :]
        if k_old is None or n == 0:
            return k_new, v_new
        return torch.cat([k_old, k_new], dim=-2), torch.cat([v_old, v_new], dim=-2)

    def checkpointed(self, checkpoint_fn, call, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """`call(hidden)` (one decoder layer on this view) under `checkpoint_fn`, with every stream K/V the layer reads
        passed in and the K/V it writes passed out; the store then holds the outputs, which carry the gradient."""
        sources = {}
        for s in dict.fromkeys(self.key_streams + ([self.stream - 1] if self.copy_previous is not None else [])):
            if s != self.stream and not self.streams.has(s):
                continue
            keys, values = self._stored(s, layer_idx)  # own stream: nothing written yet, so this is the prefix
            if keys is not None and keys.shape[-2] > 0:
                sources[s] = (keys, values)
        streams = list(sources)

        def run(hidden, *kv):
            self._inputs[layer_idx] = {s: (kv[2 * i], kv[2 * i + 1]) for i, s in enumerate(streams)}
            try:
                out = call(hidden)
            finally:
                self._inputs.pop(layer_idx)
            k_new, v_new = self._appended.pop(layer_idx)
            return out, k_new, v_new

        out, k_new, v_new = checkpoint_fn(run, hidden, *[t for s in streams for t in sources[s]])
        layer = self.streams.store(self.stream).kv_layer(self.stream, layer_idx)
        n = self._prefix_len[layer_idx]
        layer.keys = k_new if n == 0 else torch.cat([layer.keys[..., :n, :], k_new], dim=-2)
        layer.values = v_new if n == 0 else torch.cat([layer.values[..., :n, :], v_new], dim=-2)
        return out

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_own, v_own = self._write(key_states, value_states, layer_idx)
        keys, values = [], []
        for s in self.key_streams:
            if not (s == self.stream or self.streams.has(s)):
                continue
            if self.streams.ragged(s):
                flat_keys, flat_values = self._stored(s, layer_idx)
                if s == self.stream and layer_idx in self._inputs:  # the prefix came in; add this call's entries
                    k_app, v_app = self._appended[layer_idx]
                    flat_keys = k_app if flat_keys is None else torch.cat([flat_keys, k_app], dim=-2)
                    flat_values = v_app if flat_values is None else torch.cat([flat_values, v_app], dim=-2)
            if self.streams.ragged(s) and self.batch_size == 1:  # one row: the flat entries are its keys, in order
                keys.append(flat_keys if flat_keys is not None else key_states[:, :, :0])
                values.append(flat_values if flat_values is not None else value_states[:, :, :0])
            elif self.streams.ragged(s):
                gather = self.streams.layout(s).rows(self.rows)
                keys.append(RaggedLayout.read(flat_keys, gather, key_states))
                values.append(RaggedLayout.read(flat_values, gather, value_states))
            elif s == self.stream:
                keys.append(self._select(k_own))
                values.append(self._select(v_own))
            else:
                other_keys, other_values = self._stored(s, layer_idx)
                if self.flat and s == 0:
                    other_keys, other_values = flatten_rows_kv(other_keys), flatten_rows_kv(other_values)
                keys.append(self._select(other_keys))
                values.append(self._select(other_values))
        k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-2)
        v = values[0] if len(values) == 1 else torch.cat(values, dim=-2)
        return k, v


VISIBILITY_MODES = ITERATION_ATTENTION_MODES + ("duo_posterior",)


# ----------------------------------------------------------------------------------------------------------------------
# Visibility predicates: which key streams a query of each depth may attend to
# ----------------------------------------------------------------------------------------------------------------------


def iteration_visibility(
    mode: str,
    query_pos: torch.Tensor,
    query_iter: int | torch.Tensor,
    key_pos: torch.Tensor,
    key_iter: torch.Tensor,
    key_valid: torch.Tensor,
    key_continue: torch.Tensor | None = None,
    query_seq: torch.Tensor | None = None,
    key_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each query may attend to, as a (B, Tq, S) bool tensor.

    Queries carry their RoPE position and stream index d (0-based depth); keys carry position, stream index, validity
    (real token, not padding), and for `duo_posterior` whether the key token really executed the next depth.

    | mode          | visible(k, q)                                                    |
    | causal        | pos_k ≤ pos_q ∧ (iter_k = 0 ∨ (pos_k = pos_q ∧ iter_k ≤ d))      |
    | duo           | pos_k ≤ pos_q ∧ iter_k ≤ d                                       |
    | duo_posterior | pos_k ≤ pos_q ∧ (iter_k < d ∨ continue_k ∨ pos_k = pos_q)        |
    | same_iter     | pos_k ≤ pos_q ∧ iter_k = d                                       |

    Every mode also requires valid_k, iter_k ≤ d, and (packed batches) seq_k = seq_q.
    """
    if mode not in VISIBILITY_MODES:
        raise ValueError(f"iteration attention mode must be one of {list(VISIBILITY_MODES)}, got {mode!r}")
    qp = query_pos[:, :, None]
    kp = key_pos[:, None, :]
    ki = key_iter[:, None, :] if key_iter.dim() == 2 else key_iter.view(1, 1, -1)
    d = query_iter[:, :, None] if torch.is_tensor(query_iter) else query_iter
    earlier_or_same = kp <= qp
    own = kp == qp
    if mode == "causal":
        visible = (ki == 0) | (own & (ki <= d))
    elif mode == "duo":
        visible = ki <= d
    elif mode == "same_iter":
        visible = ki == d
    else:
        if key_continue is None:
            raise ValueError("duo_posterior visibility needs key_continue (did the key token execute the next depth)")
        visible = (ki < d) | key_continue[:, None, :] | own
    visible = visible & earlier_or_same & (ki <= d) & key_valid[:, None, :]
    if query_seq is not None and key_seq is not None:
        visible = visible & (query_seq[:, :, None] == key_seq[:, None, :])
    return visible
