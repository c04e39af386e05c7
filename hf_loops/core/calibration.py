"""GPTQ-style calibrated weight-only quantization whose statistics come from every executed depth.

A looped model calls each shared linear once per executed depth (TaH2 M = 2: every token's depth-1 input, then the
depth-2 input of the tokens that continue). GPTQ (Frantar et al., 2022) chooses each quantized weight column so as to
minimise the layer's output error ‖X (W − Ŵ)ᵀ‖² on calibration inputs X, through the Hessian H = 2 XᵀX. Tools that
hook the first call of a module only (or that see one iteration's inputs) calibrate the shared block for depth 1 and
leave the deeper passes to chance; here H sums the inputs of every call (`iterations="all"`, the default).
`iterations="first"` keeps the first call of each forward pass only: the depth-1 statistics, for comparison.

How it fits the package's quantization (`hf_loops.core.quantization`):

1. `linear_hessians(model, batches)` runs the float model on calibration batches and accumulates H per quantizable
   linear (the module policy of `kept_modules`: decider, updater, routers and a tied head stay in full precision).
2. `gptq_quantize(path, batches, scheme)` loads the checkpoint quantized through transformers' entry point
   (`from_pretrained(path, quantization_config=quantization_config(scheme, path))`: torchao's weight-only int8 per
   output channel or int4 asymmetric per group), which fixes the grid (scales, zero points) from the float weights,
   then replaces each weight's integer data by GPTQ's choice on that grid (columns in order, lazy block updates,
   dampening `damp` × mean diag(H)). The model is then an ordinary torchao-quantized model: the fast CPU kernels,
   `save_pretrained` and reload work as for round-to-nearest.

The Hessians come from the float model in one pass (not layer by layer through already-quantized layers, as the
original GPTQ does); that is the usual one-shot simplification, stated here. Activation order is not used.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .quantization import INT4_GROUP, _require_torchao, quantizable_linears

ITERATIONS = ("all", "first")


@torch.no_grad()
def linear_hessians(model, batches: Iterable[dict], iterations: str = "all",
                    modules: Iterable[str] | None = None) -> dict[str, dict]:
    """{linear name: {"H": XᵀX (float64, in × in), "rows": number of input rows, "calls": calls seen}} over forward
    passes of `model` on `batches` (dicts of model inputs). `iterations="all"` sums every call of the linear in a
    forward pass (one per executed depth in a looped model), `"first"` only the first call of each pass (depth 1)."""
    if iterations not in ITERATIONS:
        raise ValueError(f"iterations must be one of {ITERATIONS}, got {iterations!r}")
    names = list(modules) if modules is not None else quantizable_linears(model)
    stats = {n: {"H": None, "rows": 0, "calls": 0} for n in names}
    calls_this_pass: dict[str, int] = {}
    handles = []
    for name in names:
        def hook(mod, args, _name=name):
            k = calls_this_pass.get(_name, 0)
            calls_this_pass[_name] = k + 1
            if iterations == "first" and k > 0:
                return
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            s = stats[_name]
            s["H"] = x.T @ x if s["H"] is None else s["H"] + x.T @ x
            s["rows"] += x.shape[0]
            s["calls"] += 1

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            calls_this_pass.clear()
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n, s in stats.items() if s["H"] is None]
    if missing:
        raise ValueError(f"batches: no calibration input reached {missing[:3]} (give at least one batch)")
    return stats


def _grid(w) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(scale, zero point) per (output row, column group), the group size and the integer range of a torchao
    weight-only tensor (`Int8Tensor`: one group per row; `IntxUnpackedToInt8Tensor`: per group)."""
    name = type(w).__name__
    if name == "Int8Tensor":
        scale = w.scale.reshape(w.qdata.shape[0], -1).to(torch.float64)
        zero = torch.zeros_like(scale)
        return scale, zero, w.qdata.shape[1] // scale.shape[1], -128, 127
    if name == "IntxUnpackedToInt8Tensor":
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import _DTYPE_TO_QVALUE_BOUNDS

        lo, hi = _DTYPE_TO_QVALUE_BOUNDS[w.target_dtype]
        return w.scale.to(torch.float64), w.zero_point.to(torch.float64), int(w.block_size[-1]), lo, hi
    raise ValueError(f"gptq: weight of type {name} is not a torchao weight-only int8/int4 tensor")


def gptq_columns(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 qmin: int, qmax: int, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """GPTQ on a fixed grid: the integer matrix q (out × in) for `weight`, dequantizing as (q − zero)·scale per
    (row, column group), chosen column by column to minimise ‖X (W − Ŵ)ᵀ‖² for XᵀX = `hessian`."""
    W = weight.detach().to(torch.float64).clone()
    H = hessian.clone()
    n = H.shape[0]
    dead = torch.diag(H) == 0  # inputs that were always 0: their columns cannot affect the output
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += torch.eye(n, dtype=H.dtype) * damp * torch.mean(torch.diag(H))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W, dtype=torch.int64)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, Err = W[:, i1:i2].clone(), torch.zeros(W.shape[0], i2 - i1, dtype=W.dtype)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col, g = i1 + i, (i1 + i) // group
            w, d = W1[:, i], Hinv1[i, i]
            # the ratio as torchao forms it, x · (1 / s) in float32 (float64 can land on the other side of a .5 tie)
            ratio = (w.to(torch.float32) * (1.0 / scale[:, g].to(torch.float32))).to(torch.float64)
            q = torch.clamp(torch.round(ratio) + zero[:, g], qmin, qmax)
            Q[:, col] = q.to(torch.int64)
            err = (w - (q - zero[:, g]) * scale[:, g]) / d
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err[:, i] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return Q


@torch.no_grad()
def gptq_quantize(path: str, batches: Iterable[dict], scheme: str = "int8", *, iterations: str = "all",
                  group_size: int = INT4_GROUP, damp: float = 0.01, block: int = 128, dtype=torch.float32):
    """Load the checkpoint `path` quantized (weight-only `scheme`, "int8" or "int4" with groups of `group_size`)
    through transformers' own entry point (`quantization_config(scheme, path)`), then refine every quantized linear
    by GPTQ with Hessians from `batches` (dicts of model inputs) run through the float model, over every executed
    depth (`iterations="all"`) or depth 1 only (`"first"`). Returns (model, report): the model saves and reloads as
    any torchao-quantized checkpoint; report = {"linears": n, "calls_per_pass": {name: calls of the linear per
    forward pass}, "rows": {name: calibration rows}}."""
    from transformers import AutoModelForCausalLM

    from .quantization import SCHEMES, quantization_config, quantized_linears

    _require_torchao()
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not 0 <= damp < 1:
        raise ValueError(f"damp must be in [0, 1), got {damp!r}")
    batches = list(batches)
    float_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    stats = linear_hessians(float_model, batches, iterations)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=quantization_config(scheme, path, group_size=group_size)).eval()
    names = sorted(quantized_linears(model))
    if sorted(stats) != names:
        raise ValueError(f"{path}: the quantized linears {names[:3]}... are not the calibrated ones "
                         f"{sorted(stats)[:3]}... (module policy mismatch)")
    for name in names:
        w = model.get_submodule(name).weight
        scale, zero, group, lo, hi = _grid(w)
        q = gptq_columns(float_model.get_submodule(name).weight, stats[name]["H"], scale, zero, group, lo, hi,
                         damp=damp, block=block)
        w.qdata.copy_(q.to(w.qdata.dtype))
    n_pass = max(len(batches), 1)
    return model, {"linears": len(names), "calls_per_pass": {n: stats[n]["calls"] / n_pass for n in names},
                   "rows": {n: stats[n]["rows"] for n in names}}


__all__ = ["ITERATIONS", "gptq_columns", "gptq_quantize", "linear_hessians"]
