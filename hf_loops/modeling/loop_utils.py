"""Loop machinery shared by the hf_loops architectures.

This file ships as Hub remote code next to the modeling files: it imports only torch and transformers.

- Cache slots: a looped model keeps one `DynamicLayer` per (iteration/stream, layer) inside `cache.layers`, so the
  Cache API that `generate` relies on (reorder for beam search, batch repeat/select, crop) keeps working. `generate`
  builds `DynamicCache(config=...)` with exactly `num_hidden_layers` layers; `ensure_cache_slots` extends it in place.
- `LoopCacheView` maps the layer index a shared `Qwen3DecoderLayer` was built with onto the slot of one iteration.
- Masks: float additive masks work for both eager and sdpa (a bool mask is *added* to the scores by eager).
- transformers versions (end of file): the modeling code is written against 5.24's names; the few transformers APIs that
  moved between 5.19 and 5.24 are imported from here. (The modeling files ship as flat Hub remote code and cannot import
  `hf_loops.core.compat`, which covers everything outside `modeling/`.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import sys
import typing

import torch
from transformers import masking_utils as _masking
from transformers import modeling_outputs as _outputs
from transformers.cache_utils import Cache, DynamicCache
from transformers.models.qwen3 import modeling_qwen3 as _qwen3
from transformers.utils.deprecation import deprecate_kwarg

from .kv_quant import enable_quantized_loop_cache, new_cache_layer, quantized_loop_cache_config

# Keys of a saved config.json that describe the file rather than the architecture (dropped when a config's fields are
# carried into another config class).
NON_ARCH_KEYS = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype",
                 "torch_dtype")


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
    while len(cache.layers) < num_slots:  # a quantized loop cache (kv_quant.py) adds quantized key/value slots
        cache.layers.append(new_cache_layer(cache, len(cache.layers)))
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


def block_mask(mask_mod, batch: int | None, q_len: int, kv_len: int, device):
    """A flex_attention `BlockMask` from `mask_mod(b, h, q, kv) -> bool` (True = may attend; batch None = the same for
    every row), built once and then shared by every layer of a pass."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)


def flex_block_mask(allowed: torch.Tensor):
    """bool (B, Tq, S) "may attend" → a `BlockMask`. The mask function reads the tensor, so any cross-iteration
    pattern (what flash-attention cannot express) works."""
    B, Tq, S = allowed.shape

    def mask_mod(b, h, q, kv):
        return allowed[b, q, kv]

    return block_mask(mask_mod, B, Tq, S, allowed.device)


def flex_cpu_guard(config, device: torch.device):
    """On CPU, compile flex_attention for static shapes. torch 2.13's CPU flex template fails to build (a C++ error)
    when dynamo recompiles it with dynamic shapes, which happens as soon as a looped model calls it with a second mask
    shape. Each new shape then compiles once; past dynamo's recompile limit the call runs uncompiled. Accelerators keep
    the dynamic kernel."""
    if config._attn_implementation == "flex_attention" and device.type == "cpu":
        return torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()


@contextlib.contextmanager
def explicit_mask_backend(config, attention_mask):
    """flash-attention kernels take only padding masks: a pass whose layers get an explicit (B, 1, Tq, S) mask (TaH2's
    cross-iteration visibility) runs under sdpa, while the plain causal passes (stream 0) keep flash-attention."""
    impl = config._attn_implementation
    if (isinstance(impl, str) and impl.startswith("flash_attention") and torch.is_tensor(attention_mask)
            and attention_mask.dim() == 4):
        config._attn_implementation_internal = "sdpa"
        try:
            yield
        finally:
            config._attn_implementation_internal = impl
    else:
        yield


def iteration_mask(allowed: torch.Tensor, config, dtype: torch.dtype):
    """The mask object the configured attention backend takes for an explicit (B, Tq, S) visibility pattern: a
    `BlockMask` for flex_attention, otherwise a float additive (B, 1, Tq, S) mask (eager and sdpa)."""
    if config._attn_implementation == "flex_attention":
        return flex_block_mask(allowed)
    return additive_mask(allowed[:, None], dtype)


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


class LayerCollector:
    """Per-layer outputs of one backbone pass for `output_hidden_states` / `output_attentions`, in Qwen3's convention:
    hidden states = (embeddings, output of layer 1, …, output of layer L−1, final-normed output of layer L); attention
    weights (B, H, T, S) per layer, which only the eager path computes (sdpa never returns them)."""

    def __init__(self, want_hidden: bool, want_attentions: bool):
        self.want_hidden = want_hidden
        self.hidden: list = []
        self.attentions: list | None = [] if want_attentions else None

    @classmethod
    def requested(cls, config, output_hidden_states, output_attentions) -> LayerCollector | None:
        want_hidden = bool(config.output_hidden_states if output_hidden_states is None else output_hidden_states)
        want_attn = bool(config.output_attentions if output_attentions is None else output_attentions)
        if want_attn and config._attn_implementation != "eager":
            raise ValueError(
                f"output_attentions=True needs attn_implementation='eager' (got {config._attn_implementation!r}, which "
                "never returns attention weights); load with attn_implementation='eager', or use "
                "hf_loops.analysis.capture_trace"
            )
        return cls(want_hidden, want_attn) if want_hidden or want_attn else None

    @contextlib.contextmanager
    def attention_weights_of(self, layer, first_call_only: bool = False):
        """Record the weights the layer's eager attention returns (the decoder layer itself drops them); with
        `first_call_only`, only its first call's (a layer applied several times, e.g. SGT's Block Loop)."""
        start = len(self.attentions)

        def hook(_module, _inputs, out):
            if not (first_call_only and len(self.attentions) > start):
                self.attentions.append(out[1])

        handle = layer.self_attn.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def hidden_states(self, final_normed: torch.Tensor) -> tuple:
        return tuple(self.hidden) + (final_normed,)


# ----------------------------------------------------------------------------------------------------------------------
# Configuration checks shared by the three configs: one rule, one message shape ("Config.field must be …, got …").
# ----------------------------------------------------------------------------------------------------------------------


def literal_choices(config_class, field: str) -> tuple:
    """Allowed values of a `Literal[...]`-annotated config field (the annotation is the one source of the choices)."""
    for klass in config_class.__mro__:
        annotation = klass.__dict__.get("__annotations__", {}).get(field)
        if annotation is None:
            continue
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = eval(annotation, vars(sys.modules[klass.__module__]))
        if typing.get_origin(annotation) is typing.Literal:
            return typing.get_args(annotation)
        args = typing.get_args(annotation)  # Literal[...] | None
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        if literals:
            return typing.get_args(literals[0]) + ((None,) if type(None) in args else ())
        break
    raise TypeError(f"{config_class.__name__}.{field} is not a Literal-typed field")


def literal_fields(config_class) -> list[str]:
    """Names of the Literal-typed fields a config class declares itself (not Qwen3's)."""
    names = []
    for klass in config_class.__mro__:
        if klass.__module__.startswith("transformers."):
            break
        for name, annotation in klass.__dict__.get("__annotations__", {}).items():
            text = annotation if isinstance(annotation, str) else repr(annotation)
            if "Literal[" in text and name not in names:
                names.append(name)
    return names


def check_choice_fields(config) -> None:
    """Every Literal-typed field of `config` holds one of its allowed values."""
    cls = type(config)
    for name in literal_fields(cls):
        allowed = literal_choices(cls, name)
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"{cls.__name__}.{name} must be one of {list(allowed)}, got {value!r}")


def check_loop_knobs(max_iterations=None, exit_threshold=None, owner: str = "") -> None:
    """The one validation of the adaptive-depth loop knobs, as config fields and as per-call overrides (forward,
    generate, hf_loops.inference): `max_iterations` an integer >= 1, `exit_threshold` a number in the open interval
    (0, 1) (NaN refused). None = not given. `owner` prefixes the name in the message ("TaH2Config.")."""
    m = max_iterations
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"{owner}max_iterations must be an integer >= 1, got {m!r}")
    tau = exit_threshold
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau < 1.0):
        raise ValueError(f"{owner}exit_threshold must be in the open interval (0, 1), got {tau!r}")


def check_attn_implementation(impl, arch: str, allowed: tuple[str, ...], needs_mask_function: bool = False,
                              reason: str = "") -> None:
    """`impl` is one of `allowed`, or a custom attention function registered with transformers' `AttentionInterface`
    (and `AttentionMaskInterface` when `needs_mask_function`: the model lets transformers build its masks), e.g.
    hf_loops.analysis's recording functions. Flash kernels not in `allowed` and paged attention are refused (`reason`
    says why for this architecture). None = transformers' default (sdpa)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl in allowed or (impl is None and "sdpa" in allowed):
        return
    custom = (impl is not None and not str(impl).startswith(("flash_attention", "paged"))
              and impl in ALL_ATTENTION_FUNCTIONS.valid_keys()
              and (not needs_mask_function or impl in ALL_MASK_ATTENTION_FUNCTIONS))
    if not custom:
        registries = "AttentionInterface" + (" and AttentionMaskInterface" if needs_mask_function else "")
        raise ValueError(
            f"{arch} supports attn_implementation from a fixed set, got attn_implementation={impl!r}; allowed values: "
            f"{', '.join(repr(a) for a in allowed)}, or a custom function registered with {registries}"
            + (f" ({reason})" if reason else "")
        )


def check_int_field(config, name: str, minimum: int, maximum: int | None = None) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{type(config).__name__}.{name} must be an integer {bound}, got {value!r}")


def validated_at_load(result):
    """`from_pretrained(dir, field=value)` sets load-time values after `__init__` (`PreTrainedConfig.from_dict`): run the
    config's own checks on the result too (a config or a (config, unused kwargs) pair)."""
    (result[0] if isinstance(result, tuple) else result).check_loop_fields()
    return result


def closest_name(name: str, candidates) -> str | None:
    """The valid name a misspelt key most likely meant (None if nothing is close)."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def config_field_names(config_class) -> set[str]:
    """Every declared field of a config class (its own, Qwen3's and PreTrainedConfig's) and their aliases."""
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    for klass in config_class.__mro__:
        names.update(klass.__dict__.get("__annotations__", {}))
        names.update(getattr(klass, "attribute_map", {}) or {})
    return {n for n in names if not n.startswith("_")}


def check_known_keys(config_class, overrides: dict, what: str = "config field") -> None:
    """Unknown keys are errors naming the closest valid one (`max_iteration` → "did you mean max_iterations?").

    A key that is not a declared field is still known when the config consumes it (a legacy spelling such as Qwen3's
    `rope_theta`, folded into `rope_parameters`); anything the config would only store verbatim is unknown."""
    valid = config_field_names(config_class)
    for key, value in overrides.items():
        if key in valid:
            continue
        try:
            consumed = key not in vars(config_class(**{key: value}))
        except (TypeError, ValueError):
            consumed = False
        if not consumed:
            guess = closest_name(key, valid)
            hint = f"; did you mean {guess}?" if guess else ""
            raise ValueError(f"unknown {config_class.__name__} {what} {key!r}{hint}")


def _slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' `slice_logits_to_keep` (added in 5.20), for older versions: an int keeps the last n positions
    (0 keeps all), a 1-D tensor those positions, a 2-D integer tensor per-row positions, a 2-D bool tensor the True
    positions (flattened)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden_states[:, logits_to_keep, :]


# ----------------------------------------------------------------------------------------------------------------------
# transformers versions. 5.24 renamed the cache `past_key_values` -> `cache` everywhere at once: the forward keyword
# (the old one deprecated until 5.40), the mask helpers' parameter, the model outputs' field. The modeling code uses
# `cache` and imports the five names below from here; under 5.19-5.23 they translate to `past_key_values`, the name
# that version's `generate`, layers and users pass and read. Detected from the API itself, not from a version number.
# ----------------------------------------------------------------------------------------------------------------------

CACHE_RENAMED = "cache" in inspect.signature(_masking.create_causal_mask).parameters
HF_CACHE_KWARG = "cache" if CACHE_RENAMED else "past_key_values"  # what transformers' own layers and helpers take

try:
    from transformers.modeling_utils import slice_logits_to_keep  # 5.20+
except ImportError:  # 5.19 (vLLM 0.32's pin): our copy of the same slicing
    slice_logits_to_keep = _slice_logits_to_keep


def accepts_cache_kwarg(forward):
    """A forward taking `cache=` also takes `past_key_values=`: deprecated (a warning) on 5.24+, as transformers' own
    models do; under 5.19-5.23 it is the name `generate` passes, renamed silently."""
    if CACHE_RENAMED:
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            value = kwargs.pop("past_key_values")
            if kwargs.get("cache") is None:
                kwargs["cache"] = value
        return forward(*args, **kwargs)

    return wrapper


def create_causal_mask(*, cache=None, **kwargs):
    """transformers' `create_causal_mask`, called with `cache=` on every version."""
    return _masking.create_causal_mask(**{HF_CACHE_KWARG: cache}, **kwargs)


def create_sliding_window_causal_mask(*, cache=None, **kwargs):
    """transformers' `create_sliding_window_causal_mask`, called with `cache=` on every version."""
    return _masking.create_sliding_window_causal_mask(**{HF_CACHE_KWARG: cache}, **kwargs)


def cache_output(cls):
    """A `ModelOutput` dataclass whose cache field is `cache` (5.24's name). Under 5.19-5.23 the field is stored as
    `past_key_values`, the key that version's `generate` reads back, and `cache` stays an alias (keyword and
    attribute) for our code. `cls` either declares `cache` (our outputs) or `past_key_values` (transformers' own)."""
    if CACHE_RENAMED:
        return cls
    fields = dataclasses.fields(cls)
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "cache": property(lambda self: self.past_key_values,
                                   lambda self, value: setattr(self, "past_key_values", value))}
    if any(f.name == "cache" for f in fields):
        spec = [("past_key_values" if f.name == "cache" else f.name, f.type, dataclasses.field(default=f.default))
                for f in fields]
        new = dataclasses.make_dataclass(cls.__name__, spec, bases=cls.__bases__, namespace=namespace)
    else:
        new = dataclasses.make_dataclass(cls.__name__, [], bases=(cls,), namespace=namespace)
    init = new.__init__

    @functools.wraps(init)
    def __init__(self, *args, cache=None, **kwargs):
        if cache is not None:
            kwargs.setdefault("past_key_values", cache)
        init(self, *args, **kwargs)

    new.__init__ = __init__
    return new


BaseModelOutputWithPast = cache_output(_outputs.BaseModelOutputWithPast)
CausalLMOutputWithPast = cache_output(_outputs.CausalLMOutputWithPast)

if CACHE_RENAMED:
    Qwen3DecoderLayer = _qwen3.Qwen3DecoderLayer
else:
    class Qwen3DecoderLayer(_qwen3.Qwen3DecoderLayer):
        """transformers' `Qwen3DecoderLayer` (same parameters, same class name for `_no_split_modules` and FSDP wrap
        policies) called with `cache=`: before 5.24 the layer reads `past_key_values` and would ignore `cache`."""

        def forward(self, hidden_states, *args, cache=None, **kwargs):
            if cache is not None or "past_key_values" not in kwargs:
                kwargs["past_key_values"] = cache
            return super().forward(hidden_states, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve
# --continuous-batching`). Its `PagedAttentionCache` gives one paged slot to each of `config.num_hidden_layers` layers
# (grouped by `config.layer_types`); a looped model needs one per (iteration, layer) or per extra attention call. The
# model declares the layer types of all its slots (`paged_cache_layer_types`) and the manager's cache is sized from a
# config view that presents them as layers (`PagedSlotsConfig`); each attention call then updates the cache with its
# own slot index, as it does with `DynamicCache`. Same API in 5.19 and 5.24.
# ----------------------------------------------------------------------------------------------------------------------

try:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
except ImportError:  # pragma: no cover  (every supported transformers has it)
    PagedAttentionCache = None

# Attention implementations a looped model runs under continuous batching: those whose paged path computes the K/V
# read-back from the cache and takes the batch's explicit mask (flash's block-table fast path writes the cache inside
# the kernel, with the layer's own head layout, and has no mask for cross-iteration visibility).
PAGED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "paged|eager")


def _paged_eager_updates_the_cache() -> bool:
    """Before 5.24 (5.19 at least), `paged|eager` updates the paged cache itself, at the module's own `layer_idx`, so
    a loop's call cannot use its own slot: there only sdpa runs looped models under continuous batching."""
    try:
        from transformers.integrations.eager_paged import eager_paged_attention_forward

        return "cache.update(" in inspect.getsource(eager_paged_attention_forward)
    except (ImportError, OSError, TypeError):  # pragma: no cover
        return True


PAGED_EAGER_UPDATES_CACHE = _paged_eager_updates_the_cache()


def is_paged_cache(cache) -> bool:
    """Is `cache` transformers' continuous-batching cache (the one `generate_batch` hands the model)?"""
    return PagedAttentionCache is not None and isinstance(cache, PagedAttentionCache)


def paged_update(cache, key_states, value_states, slot: int, paged_kwargs: dict):
    """Write this call's K/V to paged slot `slot` and read back the batch's keys/values of that slot (past + new, in
    the layout of the batch's attention mask). `paged_kwargs` (the continuous-batching keywords of the model call:
    read/write indices, cumulative lengths) is copied: the cache narrows its copy to the slot's layer group."""
    return cache.update(key_states, value_states, slot, dict(paged_kwargs))


class PagedSlotsConfig:
    """A read-only view of a model config that presents one layer per paged cache slot (`layer_types`, one entry per
    slot) to transformers' continuous-batching manager and cache; everything else is the model's config."""

    def __init__(self, config, layer_types):
        self.__dict__["_config"] = config
        self.__dict__["layer_types"] = list(layer_types)
        self.__dict__["num_hidden_layers"] = len(layer_types)

    def __getattr__(self, name):
        return getattr(self.__dict__["_config"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_config"], name, value)

    def get_text_config(self, *args, **kwargs):
        return self


class PagedModelView:
    """The model as a continuous-batching manager holds it: the same module (calls, attributes, attention switches go
    to it), whose `config` is a `PagedSlotsConfig` so the manager's paged cache has every slot the model writes."""

    def __init__(self, model, config: PagedSlotsConfig):
        self.__dict__["_model"] = model
        self.__dict__["config"] = config

    def __getattr__(self, name):
        return getattr(self.__dict__["_model"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_model"], name, value)

    def __call__(self, *args, **kwargs):
        return self.__dict__["_model"](*args, **kwargs)


class QuantizedLoopCacheMixin:
    """`generate(..., cache_implementation="quantized", cache_config={"nbits": 8, "residual_length": 32,
    "q_group_size": None})` for a looped model: a `DynamicCache` whose key/value slots (every iteration's) store
    per-token int8 / int4 codes (kv_quant.py), instead of transformers' `QuantizedCache`, which cannot hold loop slots.
    A model says why it cannot use one (`quantized_loop_cache_refusal`, a one-line reason or None)."""

    @classmethod
    def quantized_loop_cache_refusal(cls, config) -> str | None:
        return None

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if (generation_config.cache_implementation != "quantized" or generation_config.use_cache is False
                or model_kwargs.get(HF_CACHE_KWARG) is not None):
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        model_kwargs[HF_CACHE_KWARG] = quantized_loop_cache(self, **(generation_config.cache_config or {}))


def quantized_loop_cache(model, **cache_config) -> DynamicCache:
    """An empty quantized loop cache for `model` (pass it as `cache=`, or let `generate(cache_implementation=
    "quantized", cache_config=...)` build it). Keys: nbits (4 or 8, default 8), residual_length (default 32),
    q_group_size (default: the head dim), backend ("loop", the only one)."""
    settings = quantized_loop_cache_config(cache_config)
    reason = type(model).quantized_loop_cache_refusal(model.config) if hasattr(model, "quantized_loop_cache_refusal") \
        else None
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot use the quantized loop cache: {reason}")
    text = model.config.get_text_config(decoder=True)
    settings.group(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)  # fail early
    return enable_quantized_loop_cache(DynamicCache(config=text), settings)


class LoopedContinuousBatchingMixin:
    """`init_continuous_batching` (and so `generate_batch`, `continuous_batching_context_manager`, `transformers serve
    --continuous-batching`) for a looped model. The model says why it cannot be served (`continuous_batching_refusal`,
    a one-line reason or None) and the layer type of every paged slot it writes (`paged_cache_layer_types`); refused
    models and unsupported attention implementations raise a one-line `ValueError` before any manager exists.
    The manager's automatic switch to flash attention is turned off (see `PAGED_ATTENTION_IMPLEMENTATIONS`)."""

    @classmethod
    def continuous_batching_refusal(cls, config) -> str | None:
        return None

    def paged_cache_layer_types(self) -> list[str]:
        raise NotImplementedError

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, *args, **kwargs):
        import copy

        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        name = type(self).__name__
        reason = self.continuous_batching_refusal(self.config)
        if reason is not None:
            raise ValueError(f"{name} cannot run under transformers' continuous batching: {reason}")
        impl = self.config._attn_implementation
        if PAGED_EAGER_UPDATES_CACHE and impl != "sdpa":
            raise ValueError(f"{name} runs under continuous batching with attn_implementation 'sdpa' on this "
                             f"transformers (its paged eager attention writes the cache at the module's own layer "
                             f"index, not a loop's slot), got {impl!r}: load the model with attn_implementation='sdpa'")
        if impl not in PAGED_ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"{name} runs under continuous batching with attn_implementation 'sdpa' or 'eager', got "
                             f"{impl!r}: load the model with attn_implementation='sdpa'")
        if continuous_batching_config is None:
            legacy = getattr(generation_config if generation_config is not None else self.generation_config,
                             "continuous_batching_config", None)
            continuous_batching_config = legacy if isinstance(legacy, ContinuousBatchingConfig) else None
        cb_config = copy.copy(continuous_batching_config) if continuous_batching_config is not None \
            else ContinuousBatchingConfig()
        cb_config.auto_switch_to_flash = False
        manager = super().init_continuous_batching(generation_config, cb_config, *args, **kwargs)
        if not isinstance(manager.model, PagedModelView):
            manager.model = PagedModelView(self, PagedSlotsConfig(self.config, self.paged_cache_layer_types()))
        return manager
