"""Weight-only int8 / int4 quantization of the looped models through transformers' torchao entry point.

A looped model reads its shared weights once per executed depth, so on memory-bound decoding (batch 1-8) the bytes of
its weights are its cost. Everything here goes through transformers' own quantizer::

    from hf_loops.core.quantization import quantization_config
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config("int8", path))

- `quantization_config(scheme, model)`: the `TorchAoConfig` to pass (int8: torchao's `Int8WeightOnlyConfig`,
  per-channel symmetric; int4: `IntxWeightOnlyConfig(torch.int4, PerGroup(group_size))`), with the module policy of
  the architecture in `modules_to_not_convert`, and it turns on the fast CPU kernels below.
- The module policy (`kept_modules`): every linear of the backbone and the untied LM head is quantized; the loop's
  control stays in the checkpoint's precision (TaH2's decider and updater, SpiralFormer's scorers, allocators and
  mesh routers: a few weights each, and they decide how often the rest runs). A tied LM head is the embedding matrix
  and stays unquantized, as transformers leaves it.
- `enable_cpu_kernels()`: torchao 0.18's int8 weight-only linear casts the int8 weight to the activation dtype and
  runs a float matmul (slower than float32), and its CPU int4 format (`Int4OpaqueTensor`) cannot be saved. This
  registers, for torchao's own (saveable) `Int8Tensor` and `IntxUnpackedToInt8Tensor`, a CPU linear that calls the
  packed kernels in torch: `torch._weight_int8pack_mm` and `torch._weight_int4pack_mm_for_cpu` (the int4 weight is
  packed once, on the first call, and cached on the tensor). Both kernels are fast only with bfloat16 activations,
  so the quantized linears compute in bfloat16 (the rest of the model keeps its dtype; the output is cast back).
  Anything else (another device, autograd through the input, per-group int8, activation quantization) falls back to
  torchao's own implementation. Saved checkpoints are plain torchao ones; a reload gets the fast path after
  `enable_cpu_kernels()` (which `quantization_config` and `load_quantized` call).
- `collect_depth_inputs(model, ...)`: the inputs of every shared linear at every executed depth (forward hooks that
  stay on across the loop's iterations) - what a calibrated method must see. torchao 0.18's calibrated schemes
  (GPTQ, AWQ, SmoothQuant) are not wired here (see docs/quantization.md).

torchao is imported inside the functions only (the `quant` extra)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from collections.abc import Iterable

import torch

__all__ = [
    "SCHEMES",
    "collect_depth_inputs",
    "cpu_kernels_enabled",
    "disable_cpu_kernels",
    "enable_cpu_kernels",
    "is_available",
    "kept_modules",
    "load_quantized",
    "quantizable_linears",
    "quantization_config",
    "quantized_linears",
    "register_weight_ops",
]

SCHEMES = ("int8", "int4")
INT4_GROUP = 128  # torch's CPU int4 kernel takes groups of 32, 64 or 128 input channels

# The loop's control per architecture: kept in the checkpoint's precision (module-name prefixes under the LM).
LOOP_CONTROL = {
    "tah2": ("decider", "updater"),
    "spiralformer": ("model.scorers", "model.allocators", "model.routers"),
    "sgt": (),
}


def is_available() -> bool:
    """torchao is installed (`pip install -e ".[quant]"`)."""
    return importlib.util.find_spec("torchao") is not None


def _require_torchao():
    if not is_available():
        raise ImportError('quantization needs torchao: pip install -e ".[quant]" (or pip install torchao)')


def _config_of(model_or_config):
    if isinstance(model_or_config, str):
        from transformers import AutoConfig

        import hf_loops  # noqa: F401  (registers the architectures)

        return AutoConfig.from_pretrained(model_or_config)
    return getattr(model_or_config, "config", model_or_config)


def kept_modules(model_or_config, *, keep_loop_control: bool = True, quantize_lm_head: bool = True) -> list[str]:
    """The module names `modules_to_not_convert` gets: the loop's control (`LOOP_CONTROL`, unless
    `keep_loop_control=False`) and the LM head when it is tied to the embeddings or `quantize_lm_head=False`."""
    config = _config_of(model_or_config)
    kept = list(LOOP_CONTROL.get(getattr(config, "model_type", ""), ())) if keep_loop_control else []
    if getattr(config, "tie_word_embeddings", False) or not quantize_lm_head:
        kept.append("lm_head")
    # transformers adds its own default skips only when the list is None; an empty list quantizes every linear.
    return kept


def _ao_config(scheme: str, group_size: int):
    if scheme == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig()
    if scheme == "int4":
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.quant_primitives import MappingType

        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size),
                                    mapping_type=MappingType.ASYMMETRIC)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def quantization_config(scheme: str = "int8", model_or_config=None, *, keep_loop_control: bool = True,
                        quantize_lm_head: bool = True, group_size: int = INT4_GROUP, cpu_kernels: bool = True):
    """The `TorchAoConfig` for `from_pretrained(..., quantization_config=...)`: weight-only `scheme` ("int8" or
    "int4", group `group_size`) with the module policy of `model_or_config` (a model, a config or a checkpoint path;
    None: every linear is quantized). Turns on the fast CPU kernels (`enable_cpu_kernels`) unless `cpu_kernels=False`."""
    _require_torchao()
    from transformers import TorchAoConfig

    kept = [] if model_or_config is None else kept_modules(
        model_or_config, keep_loop_control=keep_loop_control, quantize_lm_head=quantize_lm_head)
    if cpu_kernels:
        enable_cpu_kernels()
    return TorchAoConfig(quant_type=_ao_config(scheme, group_size), modules_to_not_convert=kept)


def load_quantized(path: str, scheme: str | None = None, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` of `path` in eval mode: quantized with `scheme` on load, or (None) a
    checkpoint saved quantized, with the fast CPU kernels on. `kwargs` go to `quantization_config` (when quantizing)."""
    _require_torchao()
    from transformers import AutoModelForCausalLM

    import hf_loops  # noqa: F401

    enable_cpu_kernels()
    extra = {} if scheme is None else {"quantization_config": quantization_config(scheme, path, **kwargs)}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def quantized_linears(model) -> dict[str, str]:
    """{module name: torchao tensor class} of every linear whose weight is quantized."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and type(module.weight).__module__.startswith("torchao"):
            out[name] = type(module.weight).__name__
    return out


# ----------------------------------------------------------------------------------------------------------------------
# fast CPU kernels

_FAST_DTYPES = (torch.float32, torch.bfloat16)
_state: dict = {"enabled": False, "original": {}}


def _fast_ok(x: torch.Tensor, w) -> bool:
    return (x.device.type == "cpu" and w.qdata.device.type == "cpu" and x.dtype in _FAST_DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad) and x.shape[-1] == w.qdata.shape[-1])


def _cached(w, key: str, make):
    """`make()` cached on the tensor object, rebuilt when its qdata is replaced or changed in place."""
    stamp = (w.qdata.data_ptr(), w.qdata._version)
    hit = getattr(w, key, None)
    if hit is None or hit[0] != stamp:
        hit = (stamp, make())
        setattr(w, key, hit)
    return hit[1]


def _aligned(w) -> None:
    """A reloaded checkpoint's int8 data can sit at an odd address of the memory-mapped safetensors file; the packed
    kernel's vector loads then fault (a segmentation fault, not an error). Such data is copied once into a fresh
    (aligned, contiguous) tensor, in place of the mapped one."""
    if w.qdata.data_ptr() % 64 or not w.qdata.is_contiguous():
        w.qdata = w.qdata.contiguous().clone()


def _int8_linear(x: torch.Tensor, w, bias):
    """x @ (qdata * scale)ᵀ by `torch._weight_int8pack_mm`: (M, K) bfloat16 × (N, K) int8 with (N,) scales."""
    _aligned(w)
    scale = _cached(w, "_hf_loops_bf16_scale", lambda: w.scale.reshape(-1).to(torch.bfloat16).contiguous())
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch._weight_int8pack_mm(a, w.qdata, scale).reshape(*x.shape[:-1], w.qdata.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def _int4_pack(w):
    """torchao's unpacked int4 (qdata in [-8, 7] as int8, scale and int8 zero point per group, w = (q − zp)·s) in
    the CPU kernel's layout: uint4 q + 8 packed two per byte, and per group (scale, zero) with w = (u − 8)·s + zero,
    so zero = −zp·s."""
    group = w.block_size[-1]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((w.qdata.to(torch.int32) + 8).contiguous(), 1)
    scale = w.scale.to(torch.float32)
    zero = -w.zero_point.to(torch.float32) * scale
    scale_and_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (K/g, N, 2)
    return packed, group, scale_and_zero


def _int4_linear(x: torch.Tensor, w, bias):
    packed, group, scale_and_zero = _cached(w, "_hf_loops_int4_pack", lambda: _int4_pack(w))
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scale_and_zero)
    y = y.reshape(*x.shape[:-1], w.qdata.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def _int8_fast_case(x, w) -> bool:
    # torch 2.13's int8 CPU kernel reads K in blocks of 16: other K fault or return garbage
    return (_fast_ok(x, w) and w.act_quant_kwargs is None and w.act_pre_scale is None
            and tuple(w.block_size) == (1, w.qdata.shape[-1]) and w.scale.numel() == w.qdata.shape[0]
            and w.qdata.shape[-1] % 16 == 0)


def _int4_fast_case(x, w) -> bool:
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import _DTYPE_TO_QVALUE_BOUNDS

    return (_fast_ok(x, w) and w.activation_quantization is None and w.target_dtype == torch.int4
            and _DTYPE_TO_QVALUE_BOUNDS[torch.int4] == (-8, 7) and w.block_size[0] == 1
            and w.block_size[-1] in (32, 64, 128) and w.qdata.shape[-1] % w.block_size[-1] == 0
            and w.qdata.shape[0] % 16 == 0)  # the CPU int4 packing takes N in multiples of 16


def _dispatcher(fast_case, fast, original):
    def linear(func, types, args, kwargs):
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
        if fast_case(x, w):
            return fast(x, w, bias)
        return original(func, types, args, kwargs)

    linear._hf_loops_fast = True
    return linear


def _tables():
    from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

    for cls, fast_case, fast in ((Int8Tensor, _int8_fast_case, _int8_linear),
                                 (IntxUnpackedToInt8Tensor, _int4_fast_case, _int4_linear)):
        yield cls, cls._TORCH_FN_TABLE[cls], torch.nn.functional.linear, fast_case, fast
        yield cls, cls._ATEN_OP_TABLE[cls], torch.ops.aten.linear.default, fast_case, fast


def _dequantized_index_select(func, types, args, kwargs):
    return args[0].dequantize().index_select(*args[1:], **(kwargs or {}))


def _slice_or_dequantize(original):
    def slice_(func, types, args, kwargs):
        try:
            return original(func, types, args, kwargs)
        except (ValueError, AssertionError, RuntimeError):  # a slice across a quantization group
            w = args[0]
            return w.dequantize()[(slice(None),) * (args[1] if len(args) > 1 else 0) + (slice(*args[2:5]),)]

    slice_._hf_loops_fast = True
    return slice_


def register_weight_ops() -> None:
    """The weight ops SGT's sliced loops use on a quantized weight: `index_select` (a non-contiguous head subset)
    and a column slice across int4 groups (W_O of a head subset). torchao 0.18 has neither; both dequantize here
    (correct, not fast). Idempotent, process-wide."""
    _require_torchao()
    from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

    aten = torch.ops.aten
    for cls in (Int8Tensor, IntxUnpackedToInt8Tensor):
        table = cls._ATEN_OP_TABLE[cls]
        table.setdefault(aten.index_select.default, _dequantized_index_select)
        if not getattr(table[aten.slice.Tensor], "_hf_loops_fast", False):
            table[aten.slice.Tensor] = _slice_or_dequantize(table[aten.slice.Tensor])


def enable_cpu_kernels() -> None:
    """Route CPU linears of torchao's int8 (`Int8Tensor`, per channel, weight-only) and int4
    (`IntxUnpackedToInt8Tensor`, per group, weight-only) weights to torch's packed CPU kernels, bfloat16 activations
    (process-wide, idempotent; `disable_cpu_kernels` undoes it)."""
    register_weight_ops()
    if _state["enabled"]:
        return
    for cls, table, fn, fast_case, fast in _tables():
        original = table[fn]
        _state["original"][(cls, fn)] = original
        table[fn] = _dispatcher(fast_case, fast, original)
    _state["enabled"] = True


def disable_cpu_kernels() -> None:
    """torchao's own linear again."""
    if not _state["enabled"]:
        return
    for cls, table, fn, _, _ in _tables():
        table[fn] = _state["original"].pop((cls, fn))
    _state["enabled"] = False


def cpu_kernels_enabled() -> bool:
    return _state["enabled"]


# ----------------------------------------------------------------------------------------------------------------------
# calibration: what the shared linears see at every executed depth


def quantizable_linears(model) -> list[str]:
    """The names of the linears the module policy quantizes (every `nn.Linear` outside `kept_modules(model)`)."""
    kept = kept_modules(model)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not any(n == k or n.startswith(k + ".") for k in kept)]


@torch.no_grad()
def collect_depth_inputs(model, batches: Iterable[dict], modules: Iterable[str] | None = None,
                         max_rows: int | None = None) -> dict[str, list[torch.Tensor]]:
    """{linear name: [its input rows of each call, in order]} over forward passes on `batches` (dicts of model
    inputs). A looped model calls a shared linear once per executed depth, so the list holds every depth's inputs
    (TaH2 M = 2: the depth-1 rows of all tokens, then the depth-2 rows of the tokens that continue). `modules`: the
    linear names to watch (default: every quantizable linear under the policy of `kept_modules`); `max_rows` caps the
    rows kept per call. A calibrated method (GPTQ Hessians, AWQ scales) must take its statistics from all of them,
    not from the first call alone."""
    names = list(modules) if modules is not None else quantizable_linears(model)
    found: dict[str, list[torch.Tensor]] = defaultdict(list)
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def hook(mod, args, _name=name):
            rows = args[0].detach().reshape(-1, args[0].shape[-1])
            found[_name].append((rows[:max_rows] if max_rows else rows).to(torch.float32).cpu())

        handles.append(module.register_forward_pre_hook(hook))
    try:
        for batch in batches:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return dict(found)
