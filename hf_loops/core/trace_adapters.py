"""What a trace is made of, and how each architecture's layer calls map to it: the records (`Step`, `Trace`,
`AttentionRecord`) and one trace adapter per architecture, which the architecture registry names
(`ArchitectureSpec.trace_adapter`). The capture itself (hooks, the recording attention function) is
`hf_loops.analysis.trace.capture_trace`.

An adapter maps the order of decoder-layer calls to (stage, recurrence, layer) coordinates and sets recurrence
counts other than the trained one by temporarily changing plain Python/config state (TaH2: `max_iterations` and a
forced `always` decision; SpiralFormer: the chunk schedule; SGT: loop depths).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

STAGES = ("pre", "loop", "post")

# ----------------------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class AttentionRecord:
    """One attention call: post-RoPE queries/keys (keys already expanded to the query heads) and what may be seen.

    Coordinates are the call's own: TaH2 packs the tokens active at a depth (`query_index` maps each query slot back
    to its token, keys span every visible stream with `key_iter`); SpiralFormer core layers see chunk latents.
    """

    query: torch.Tensor  # (B, h, Tq, d)
    key: torch.Tensor  # (B, h, Tk, d)
    visible: torch.Tensor  # (B, Tq, Tk) bool: what the model's mask allowed
    scaling: float
    heads: tuple[int, ...]  # model head index of every recorded head
    row_valid: torch.Tensor  # (B, Tq) bool
    key_valid: torch.Tensor  # (B, Tk) bool
    query_index: torch.Tensor  # (B, Tq) long: token (or latent) index of each query slot
    key_index: torch.Tensor  # (B, Tk) long
    key_iter: torch.Tensor | None = None  # (B, Tk) long, TaH2 stream of each key
    eager_weights: torch.Tensor | None = None  # (B, h, Tq, Tk) when the model itself ran eager

    @property
    def shape(self) -> tuple[int, int]:
        return self.query.shape[2], self.key.shape[2]

    def weights(self, chunk_size: int = 256) -> torch.Tensor:
        """A = softmax(scaling · Q Kᵀ) over the visible keys, fp32, (B, h, Tq, Tk); zero rows for invalid queries."""
        q, k = self.query.float(), self.key.float()
        vis = self.visible & self.key_valid[:, None, :] & self.row_valid[:, :, None]
        out = []
        for s in range(0, q.shape[2], chunk_size):
            logits = torch.matmul(q[:, :, s : s + chunk_size], k.transpose(-1, -2)) * self.scaling
            v = vis[:, None, s : s + chunk_size]
            logits = logits.masked_fill(~v, float("-inf"))
            a = torch.softmax(logits, dim=-1)
            out.append(torch.where(v, a, torch.zeros((), device=a.device)))  # rows with nothing visible → 0, not NaN
        return torch.cat(out, dim=2)

    def masks(self) -> dict:
        """The keyword arguments every attention metric takes."""
        return {"row_mask": self.row_valid, "key_mask": self.key_valid, "visible": self.visible,
                "query_pos": self.query_index, "key_pos": self.key_index}


@dataclass
class Step:
    """One realised step: one application of one layer (SGT: one attention pass of a looped layer)."""

    index: int  # realised depth index, 0-based, in execution order
    stage: str  # "pre" | "loop" | "post"
    recurrence: int | None  # t = 1..R for loop steps (SGT: t = k + 1), None for pre/post
    layer: int  # 1-based layer within its stage (loop: within the looped block)
    physical_layer: int  # index into model.layers
    residual: torch.Tensor | None  # (B, N, D) fp32, the residual stream after this step, in the step's coordinates
    valid: torch.Tensor  # (B, N) bool
    attention: AttentionRecord | None = None
    resolution: float = 1.0  # r_t (SpiralFormer core: 1/g_t)

    @property
    def label(self) -> str:
        return f"{self.stage}{self.layer}" if self.recurrence is None else f"t{self.recurrence}.l{self.layer}"


@dataclass
class Trace:
    steps: list[Step]
    model_type: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    num_recurrences: int
    output: object = None  # the model's own output of this forward
    truncated: bool = False
    extras: dict = field(default_factory=dict)

    def loop_steps(self, layer: int | None = None) -> list[Step]:
        return [s for s in self.steps if s.stage == "loop" and (layer is None or s.layer == layer)]

    @property
    def loop_layers(self) -> list[int]:
        return sorted({s.layer for s in self.loop_steps()})

    def by_layer(self) -> dict[int, list[Step]]:
        """Loop steps of every looped layer ℓ, ordered by recurrence."""
        return {ell: sorted(self.loop_steps(ell), key=lambda s: s.recurrence) for ell in self.loop_layers}

    def loop_residuals(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, B, N, D) residuals of loop layer ℓ over recurrences and the (B, N) mask valid at every t.
        Raises `ValueError` when recurrences run at different resolutions (no common coordinates)."""
        steps = [s for s in self.by_layer()[layer] if s.residual is not None]
        if not steps:
            raise ValueError(f"no residuals recorded for loop layer {layer}")
        shapes = {tuple(s.residual.shape) for s in steps}
        if len(shapes) > 1:
            raise ValueError(f"loop layer {layer} runs at different resolutions across recurrences {sorted(shapes)}: "
                             "cross-recurrence comparisons need equal lengths")
        valid = steps[0].valid.clone()
        for s in steps[1:]:
            valid &= s.valid
        return torch.stack([s.residual for s in steps]), valid


def attention_record(entry, heads, row_valid, key_valid, query_index, key_index, key_iter=None, head_select=None):
    q, k, visible, scaling, w, _ = entry
    if head_select is not None:
        idx = torch.tensor(head_select, device=q.device)
        q, k = q.index_select(1, idx), k.index_select(1, idx)
        w = w.index_select(1, idx) if w is not None else None
    return AttentionRecord(q, k, visible, scaling, tuple(heads), row_valid, key_valid, query_index, key_index,
                           key_iter, w)


# ----------------------------------------------------------------------------------------------------------------------
# Architecture adapters: call order → coordinates; extra recurrences
# ----------------------------------------------------------------------------------------------------------------------


class PlainTraceAdapter:
    """Plain decoder stack (Qwen3 and anything with `model.model.layers`): one pass = recurrence 1."""

    def __init__(self, model, input_ids, attention_mask, num_recurrences, keep_routes):
        self.model = model
        self.config = model.config
        self.valid = attention_mask.bool()
        B, T = self.valid.shape
        self.token_index = torch.arange(T, device=input_ids.device).expand(B, T)
        self.num_heads = model.config.num_attention_heads
        self.num_recurrences = self.resolve_recurrences(num_recurrences)
        self.keep_routes = keep_routes

    def layers(self):
        return self.model.model.layers

    def resolve_recurrences(self, requested):
        if requested not in (None, 1):
            raise ValueError(f"{self.config.model_type} has no loop: num_recurrences must be 1, got {requested}")
        return 1

    @contextlib.contextmanager
    def patched(self):
        yield {}

    handles: list = []  # hooks an adapter adds during a layer call (removed by capture_trace even on failure)

    def begin(self, call):
        pass

    def token_step(self, call, out, stage, recurrence, layer, heads=None, entry=0):
        att = None
        if len(call.attention) > entry:
            att = attention_record(call.attention[entry], heads or range(self.num_heads), self.valid, self.valid,
                                    self.token_index, self.token_index)
        return Step(0, stage, recurrence, layer, call.layer_idx, out.float(), self.valid, att)

    def finish(self, call, out):
        return [self.token_step(call, out, "loop", 1, call.layer_idx + 1)]


class TaH2TraceAdapter(PlainTraceAdapter):
    """Recurrence = depth m (the whole stack); queries are the tokens active at depth m, keys every visible stream."""

    def resolve_recurrences(self, requested):
        M = self.config.max_iterations if requested is None else requested
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ValueError(f"num_recurrences must be an integer >= 1, got {requested!r}")
        if M > 1 and self.config.updater == "learned" and self.model.updater is None:
            raise ValueError("this TaH2 checkpoint has no learned updater: it cannot run more than one depth")
        return M

    @contextlib.contextmanager
    def patched(self):
        forced = self.forced = not self.keep_routes and self.requested_force
        if forced:
            def always(embeds, hidden, logits):
                return torch.full((embeds.shape[0],), float("inf"), device=embeds.device)

            self.model._continue_logit = always  # instance attribute shadows the method; removed below
        try:
            yield {"max_iterations": self.num_recurrences, "output_hidden_states": True}
        finally:
            if forced:
                del self.model._continue_logit

    def begin(self, call):
        view = call.kwargs.get("cache")
        streams, stream, rows = view.streams, view.stream, view.rows

        def sel(t):
            return t if rows is None else t.index_select(0, rows)

        new = streams.new_meta[stream]
        key_parts = [(s, streams.merged(s)) for s in view.key_streams if streams.has(s)]
        call.info = {
            "stream": stream,
            "rows": rows,
            "q_index": sel(new["index"]),
            "q_valid": sel(new["valid"]),
            "k_index": sel(torch.cat([p["index"] for _, p in key_parts], 1)),
            "k_valid": sel(torch.cat([p["valid"] for _, p in key_parts], 1)),
            "k_iter": sel(torch.cat([torch.full_like(p["pos"], s) for s, p in key_parts], 1)),
        }

    def finish(self, call, out):
        info = call.info
        B, T = self.valid.shape
        rows = info["rows"]
        rows = torch.arange(B, device=out.device) if rows is None else rows
        dense = torch.zeros(B, T, out.shape[-1], dtype=torch.float32, device=out.device)
        valid = torch.zeros(B, T, dtype=torch.bool, device=out.device)
        rb, slot = info["q_valid"].nonzero(as_tuple=True)
        ti = info["q_index"][rb, slot]
        dense[rows[rb], ti] = out[rb, slot].float()
        valid[rows[rb], ti] = True
        att = None
        if call.attention:
            att = attention_record(call.attention[0], range(self.num_heads), info["q_valid"], info["k_valid"],
                                    info["q_index"], info["k_index"], info["k_iter"])
            if info["rows"] is not None:  # keep the batch axis: rows that did not run this depth get empty entries
                att = _scatter_rows(att, info["rows"], B)
        return [Step(0, "loop", info["stream"] + 1, call.layer_idx + 1, call.layer_idx, dense, valid, att)]


def _scatter_rows(att: AttentionRecord, rows: torch.Tensor, batch: int) -> AttentionRecord:
    def full(t, fill=0):
        out = torch.full((batch,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        return out.index_copy(0, rows, t)

    return AttentionRecord(full(att.query), full(att.key), full(att.visible, False), att.scaling, att.heads,
                           full(att.row_valid, False), full(att.key_valid, False), full(att.query_index),
                           full(att.key_index), full(att.key_iter) if att.key_iter is not None else None,
                           full(att.eager_weights) if att.eager_weights is not None else None)


class SpiralFormerTraceAdapter(PlainTraceAdapter):
    """pre → core × T (recurrence t at chunk size g_t, in latent coordinates) → post."""

    def resolve_recurrences(self, requested):
        cfg = self.config
        T = len(cfg.chunk_sizes)
        if requested is None or requested == T:
            self.schedule = list(cfg.chunk_sizes)
            return T
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_recurrences must be an integer >= 1, got {requested!r}")
        if requested < T:
            self.schedule = list(cfg.chunk_sizes[:requested])
            return requested
        if cfg.topology != "anchor":
            raise ValueError(
                f"SpiralFormer with topology {cfg.topology!r} has one MeSH router per trained iteration (T = {T}): "
                f"it cannot run {requested} recurrences; only topology 'anchor' with a final chunk size of 1 can"
            )
        if cfg.chunk_sizes[-1] != 1:
            raise ValueError(
                f"SpiralFormer extra recurrences repeat the last iteration, which needs chunk size 1 (no per-iteration "
                f"scorer/allocator); this schedule ends with {cfg.chunk_sizes[-1]}: cannot run {requested} recurrences"
            )
        self.schedule = list(cfg.chunk_sizes) + [1] * (requested - T)
        return requested

    @contextlib.contextmanager
    def patched(self):
        cfg = self.config
        saved = cfg.chunk_sizes
        cfg.chunk_sizes = self.schedule
        self.t = 0
        try:
            yield {}
        finally:
            cfg.chunk_sizes = saved

    def finish(self, call, out):
        from ..modeling.modeling_spiralformer import chunk_offset

        cfg = self.config
        n_pre, n_loop = cfg.num_pre_layers, cfg.num_loop_layers
        i = call.layer_idx
        if i < n_pre:
            return [self.token_step(call, out, "pre", None, i + 1)]
        if i >= n_pre + n_loop:
            return [self.token_step(call, out, "post", None, i - n_pre - n_loop + 1)]
        if i == n_pre:
            self.t += 1
        g = self.schedule[self.t - 1]
        B, Lt = out.shape[:2]
        pos = (self.valid.long().cumsum(-1) - 1).masked_fill(~self.valid, -1)  # the model's RoPE positions
        n_real = pos.amax(dim=1) + 1
        lt_row = torch.div(n_real + chunk_offset(cfg, g), g, rounding_mode="floor")
        j = torch.arange(Lt, device=out.device)
        valid = j[None, :] < lt_row[:, None]
        index = j.expand(B, Lt)
        att = None
        if call.attention:
            att = attention_record(call.attention[0], range(self.num_heads), valid, valid, index, index)
        return [Step(0, "loop", self.t, i - n_pre + 1, i, out.float(), valid, att, resolution=1.0 / g)]


class SGTTraceAdapter(PlainTraceAdapter):
    """Heads mode: a looped layer's attention passes k = 0..K are recurrences t = k + 1 (kept heads only for k ≥ 1),
    its MLP output a post step. Block mode: every call of a looped layer is one recurrence."""

    def resolve_recurrences(self, requested):
        cfg = self.config
        self.block = cfg.loop_mode == "block"
        if self.block:
            looped = list(cfg.block_loop_layers) if cfg.block_loop_depth > 0 else []
            trained = cfg.block_loop_depth + 1
        else:
            looped = [i for i, layer in enumerate(self.model.model.layers) if layer.loop_depth > 0]
            trained = 1 + max((self.model.model.layers[i].loop_depth for i in looped), default=0)
        self.looped = looped
        if requested is None:
            return trained
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_recurrences must be an integer >= 1, got {requested!r}")
        if not looped and requested != 1:
            raise ValueError("this SGT model has no looped layer (empty loop plan): num_recurrences must be 1")
        return requested

    @contextlib.contextmanager
    def patched(self):
        cfg, layers = self.config, self.model.model.layers
        saved_block = cfg.block_loop_depth
        saved_depths = {i: layers[i].loop_depth for i in self.looped}
        if self.block:
            cfg.block_loop_depth = self.num_recurrences - 1
        else:
            for i in self.looped:
                layers[i].loop_depth = self.num_recurrences - 1
        self.calls = {}
        self.first = min(self.looped) if self.looped else len(layers)
        self.rank = {i: r + 1 for r, i in enumerate(sorted(self.looped))}
        self.stage_count = {"pre": 0, "post": 0}
        try:
            yield {}
        finally:
            cfg.block_loop_depth = saved_block
            for i, depth in saved_depths.items():
                layers[i].loop_depth = depth

    def begin(self, call):
        if not self.block and call.layer_idx in self.looped:
            layer = self.model.model.layers[call.layer_idx]
            call.info["hooks"] = self.handles = [
                layer.input_layernorm.register_forward_pre_hook(lambda m, a: call.norm_inputs.append(a[0].detach())),
                layer.post_attention_layernorm.register_forward_pre_hook(
                    lambda m, a: setattr(call, "post_attn_input", a[0].detach())),
            ]

    def _plain(self, call, out, entry=0):
        stage = "pre" if call.layer_idx < self.first else "post"
        self.stage_count[stage] += 1
        return self.token_step(call, out, stage, None, self.stage_count[stage], entry=entry)

    def finish(self, call, out):
        i = call.layer_idx
        for h in call.info.pop("hooks", []):
            h.remove()
        if i not in self.looped:
            return [self._plain(call, out)]
        if self.block:
            n = self.calls[i] = self.calls.get(i, 0) + 1
            return [self.token_step(call, out, "loop", n, self.rank[i])]
        layer = self.model.model.layers[i]
        residuals = call.norm_inputs[1:] + [call.post_attn_input]
        steps = []
        all_heads = list(range(self.num_heads))
        for k, h in enumerate(residuals):
            heads = all_heads if k == 0 else list(layer.loop_heads)
            select = heads if (k > 0 and layer.loop_masked) else None
            step = self.token_step(call, h, "loop", k + 1, self.rank[i], heads=heads, entry=k)
            if select is not None and step.attention is not None:
                step.attention = attention_record(call.attention[k], heads, self.valid, self.valid, self.token_index,
                                                   self.token_index, head_select=select)
            steps.append(step)
        steps.append(self._plain(call, out, entry=len(call.attention)))  # the MLP output: no attention of its own
        return steps


