"""Trace capture: residual streams and attention per realised step, for every hf_loops architecture and plain Qwen3,
without touching the modeling code (what is recorded, and the metrics on it: docs/analysis.md).

How it works (non-invasive, everything restored in a `finally`):
- forward pre/post hooks on the decoder layers give the residual stream after every layer call and tell which layer
  is running; the architecture's trace adapter (`hf_loops.core.trace_adapters`, named by the architecture
  registry) maps call order to (stage, recurrence, layer) coordinates;
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

from ..core.trace_adapters import STAGES, AttentionRecord, PlainTraceAdapter, Step, Trace

TRACE_SDPA = "hf_loops_trace_sdpa"
TRACE_EAGER = "hf_loops_trace_eager"
_ACTIVE: list = []  # stack of active recorders (the registered attention function reports to the top one)


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


def _adapter_for(model):
    """The architecture's trace adapter from the registry; the plain decoder stack's for anything else (Qwen3)."""
    from ..conversion.registry import ARCHITECTURES

    spec = ARCHITECTURES.get(getattr(model.config, "model_type", ""))
    return spec.trace_adapter if spec is not None and spec.trace_adapter is not None else PlainTraceAdapter


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
