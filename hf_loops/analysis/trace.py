"""Trace capture (spec: analysis.md §1): residual streams and attention per realised step, for every hf_loops
architecture and plain Qwen3, without touching the modeling code.

How it works (non-invasive, everything restored in a `finally`):
- forward pre/post hooks on the decoder layers give the residual stream after every layer call and tell which layer
  is running; the per-architecture adapter below maps call order to (stage, recurrence, layer) coordinates;
- an attention function registered with transformers' `AttentionInterface` ("hf_loops_trace_sdpa" /
  "hf_loops_trace_eager") records the post-RoPE query/key and the mask of every attention call, then runs the real
  sdpa/eager kernel; the model config is switched to it for the duration of the capture. Attention weights are
  recomputed from Q/K on demand, in chunks of query rows (`AttentionRecord.weights`);
- recurrence counts other than the trained one are set by temporarily changing plain Python/config state
  (TaH2: `max_iterations` and a forced `always` decision; SpiralFormer: the chunk schedule; SGT: loop depths).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

TRACE_SDPA = "hf_loops_trace_sdpa"
TRACE_EAGER = "hf_loops_trace_eager"
STAGES = ("pre", "loop", "post")
_ACTIVE: list = []  # stack of active recorders (the registered attention function reports to the top one)


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


# ----------------------------------------------------------------------------------------------------------------------
# Attention hook
# ----------------------------------------------------------------------------------------------------------------------


def _traced(base):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = base(module, query, key, value, attention_mask, *args, **kwargs)
        if _ACTIVE:
            _ACTIVE[-1].on_attention(module, query, key, attention_mask, kwargs.get("scaling"), weights)
        return out, weights

    return attention


def _register() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    if TRACE_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(TRACE_SDPA, _traced(sdpa_attention_forward))
        AttentionInterface.register(TRACE_EAGER, _traced(eager_attention_forward))
        AttentionMaskInterface.register(TRACE_SDPA, sdpa_mask)
        AttentionMaskInterface.register(TRACE_EAGER, eager_mask)


def _visible_from_mask(mask, batch: int, tq: int, tk: int, device) -> torch.Tensor:
    """The (B, Tq, Tk) allowed set a mask expresses: None = sdpa's top-left causal, bool = keep, float = additive."""
    if mask is None:
        if tq == 1:
            return torch.ones(batch, 1, tk, dtype=torch.bool, device=device)
        i = torch.arange(tq, device=device)[:, None]
        j = torch.arange(tk, device=device)[None, :]
        return (j <= i).expand(batch, tq, tk).clone()
    m = mask[..., :tk]
    allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    if allowed.dim() == 4:
        allowed = allowed[:, 0]
    return allowed.expand(batch, tq, tk).clone()


def _repeat_kv(key: torch.Tensor, groups: int) -> torch.Tensor:
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


@dataclass
class _Call:
    """What one decoder-layer call recorded before the adapter turns it into steps."""

    layer_idx: int
    kwargs: dict
    attention: list = field(default_factory=list)  # (q, k, visible, scaling, weights, module)
    norm_inputs: list = field(default_factory=list)  # SGT: inputs of input_layernorm (X, H0, .., H_{K-1})
    post_attn_input: torch.Tensor | None = None  # SGT: H_K
    info: dict = field(default_factory=dict)


class _Recorder:
    def __init__(self, adapter, record_attention: bool, record_residual: bool, layers):
        self.adapter = adapter
        self.record_attention = record_attention
        self.record_residual = record_residual
        self.layers = None if layers is None else set(layers)
        self.steps: list[Step] = []
        self.call: _Call | None = None

    def wanted(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers

    def on_attention(self, module, query, key, mask, scaling, weights):
        if self.call is None or not self.record_attention or not self.wanted(self.call.layer_idx):
            return
        key = _repeat_kv(key, getattr(module, "num_key_value_groups", 1))
        visible = _visible_from_mask(mask, query.shape[0], query.shape[2], key.shape[2], query.device)
        scaling = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
        w = weights.detach().float() if weights is not None else None
        self.call.attention.append((query.detach(), key.detach(), visible, float(scaling), w, module))

    def pre(self, layer_idx):
        def hook(module, args, kwargs):
            self.call = _Call(layer_idx, kwargs)
            self.adapter.begin(self.call)

        return hook

    def post(self, layer_idx):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            call, self.call = self.call, None
            for step in self.adapter.finish(call, out.detach()):
                step.index = len(self.steps)
                if not self.wanted(step.physical_layer):
                    step.residual, step.attention = None, None
                elif not self.record_residual:
                    step.residual = None
                self.steps.append(step)

        return hook


def _attention_record(entry, heads, row_valid, key_valid, query_index, key_index, key_iter=None, head_select=None):
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


class _Adapter:
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
            att = _attention_record(call.attention[entry], heads or range(self.num_heads), self.valid, self.valid,
                                    self.token_index, self.token_index)
        return Step(0, stage, recurrence, layer, call.layer_idx, out.float(), self.valid, att)

    def finish(self, call, out):
        return [self.token_step(call, out, "loop", 1, call.layer_idx + 1)]


class _TaH2Adapter(_Adapter):
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
            att = _attention_record(call.attention[0], range(self.num_heads), info["q_valid"], info["k_valid"],
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


class _SpiralAdapter(_Adapter):
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
            att = _attention_record(call.attention[0], range(self.num_heads), valid, valid, index, index)
        return [Step(0, "loop", self.t, i - n_pre + 1, i, out.float(), valid, att, resolution=1.0 / g)]


class _SGTAdapter(_Adapter):
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
                step.attention = _attention_record(call.attention[k], heads, self.valid, self.valid, self.token_index,
                                                   self.token_index, head_select=select)
            steps.append(step)
        steps.append(self._plain(call, out, entry=len(call.attention)))  # the MLP output: no attention of its own
        return steps


_ADAPTERS = {"tah2": _TaH2Adapter, "spiralformer": _SpiralAdapter, "sgt": _SGTAdapter}


def _adapter_for(model):
    return _ADAPTERS.get(getattr(model.config, "model_type", ""), _Adapter)


# ----------------------------------------------------------------------------------------------------------------------
# capture_trace
# ----------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _attention_implementation(model, name):
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                            "_attn_implementation")}
    configs[id(model.config)] = model.config
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


@torch.no_grad()
def capture_trace(model, input_ids, attention_mask=None, num_recurrences: int | None = None, max_length: int = 512,
                  record=("residual", "attention"), layers=None, keep_routes: bool = False,
                  attn_implementation: str | None = None) -> Trace:
    """Run one teacher-forced forward of `model` on `input_ids` (B, T) and record every realised step.

    num_recurrences: recurrences to run (None = as trained). TaH2: every token is forced to that depth unless
        `keep_routes=True` (the decider's own routes, up to that depth). SpiralFormer: fewer truncate the schedule,
        more repeat a final chunk-size-1 step (anchor topology only). SGT: loop depth of every looped layer.
        An architecture that cannot run the count raises `ValueError`.
    max_length: when attention is recorded, sequences are cut to their first `max_length` tokens.
    record: any of "residual", "attention". layers: physical layer indices to record (None = all).
    attn_implementation: "eager" or "sdpa" for the capture (default: the model's, sdpa for anything else).
    """
    record = tuple(record)
    unknown = set(record) - {"residual", "attention"}
    if unknown:
        raise ValueError(f"record must contain only 'residual' and 'attention', got {sorted(unknown)}")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"capture_trace needs input_ids of shape (batch, tokens) with at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask).to(device)
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    truncated = False
    if "attention" in record and input_ids.shape[1] > max_length:
        input_ids, attention_mask, truncated = input_ids[:, :max_length], attention_mask[:, :max_length], True

    adapter_cls = _adapter_for(model)
    adapter = adapter_cls(model, input_ids, attention_mask, num_recurrences, keep_routes)
    adapter.requested_force = num_recurrences is not None
    base = attn_implementation or model.config._attn_implementation
    if base not in ("eager", "sdpa"):
        base = "sdpa"
    _register()
    recorder = _Recorder(adapter, "attention" in record, "residual" in record, layers)
    handles = []
    was_training = model.training
    model.eval()
    try:
        for i, layer in enumerate(adapter.layers()):
            handles.append(layer.register_forward_pre_hook(recorder.pre(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(recorder.post(i), with_kwargs=True))
        _ACTIVE.append(recorder)
        with _attention_implementation(model, TRACE_EAGER if base == "eager" else TRACE_SDPA), \
                adapter.patched() as extra:
            output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    finally:
        if _ACTIVE and _ACTIVE[-1] is recorder:
            _ACTIVE.pop()
        for h in handles + list(adapter.handles):
            h.remove()
        model.train(was_training)
    extras = {}
    if getattr(output, "iter_counts", None) is not None:
        extras["iter_counts"] = output.iter_counts
        extras["continue_probs"] = output.continue_probs
    return Trace(recorder.steps, model.config.model_type, input_ids, attention_mask, adapter.num_recurrences,
                 output=output, truncated=truncated, extras=extras)


def final_norm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """lm_head(norm(h)): what the model makes of a residual stream recorded after its last layer."""
    norm = model.model.norm
    return model.lm_head(norm(hidden.to(next(model.parameters()).dtype))).float()


def recurrence_support_error(model, requested: int) -> str | None:
    """Why `capture_trace(model, ..., num_recurrences=requested)` cannot run, or None when it can (no model call)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    try:
        _adapter_for(model)(model, ids, torch.ones_like(ids), requested, False)
    except ValueError as err:
        return str(err)
    return None


def max_recurrence_supported(model, requested: int) -> bool:
    """Whether `capture_trace(model, ..., num_recurrences=requested)` can run (no model call)."""
    return recurrence_support_error(model, requested) is None


__all__ = ["AttentionRecord", "Step", "Trace", "capture_trace", "final_norm_logits", "max_recurrence_supported",
           "recurrence_support_error", "STAGES"]
