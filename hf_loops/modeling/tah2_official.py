"""Loading and writing a TaH2 checkpoint in the authors' layout (docs/conversion.md).

The official layout is a plain Qwen3 checkpoint (`config.json` with model_type "qwen3" + weights) plus
`tah_config.json` (the loop settings) and two `torch.save` dicts, `iter_decider.bin` and `input_updater.bin`, each
`{"class": <name>, "init_args": {...}, "state_dict": {...}}`. Our updater/decider use the official submodule names,
so the import is a prefix rename.

`TaH2ForCausalLM.from_pretrained(dir)` calls `load_official_tah2` when `dir/tah_config.json` exists. This file ships
as Hub remote code next to modeling_tah2.py: it imports only the standard library, torch and transformers.

What the authors' loader (`TaHForCausalLM.from_pretrained`, transformers 4.57) needs, and so what the writer states
explicitly (their `_merge_tah_config` lets a provided config's defaults override saved fields, and their component
loader builds each class from `tah_config.json`'s kwargs, not from the `.bin`'s `init_args`):
- `config.json`: every field 4.57's `Qwen3Config` reads — vocab_size, hidden_size, intermediate_size,
  num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_act, max_position_embeddings,
  initializer_range, rms_norm_eps, use_cache, tie_word_embeddings, attention_bias, use_sliding_window,
  sliding_window, max_window_layers, layer_types, attention_dropout, dtype, and the rotary settings in the legacy
  form `rope_theta` / `rope_scaling` beside transformers 5's `rope_parameters` (4.57 ignores `rope_parameters` and
  would fall back to rope_theta 10000);
- `tah_config.json`: every `TaHConfig` field — embedding_key, max_iter, iter_decider, input_updater, train_loss,
  eval_loss, eval_iter_decider, iter_label_generator, iter_attention_mode, attn_implementation, iter_attention_impl,
  weighted_hidden_method, memory_lean_fp32_reductions and the six `*_kwargs` dicts. The losses must name a
  registered class (`get_loss_func_class(None)` fails): `NextTokenPredLoss` for both (the recipe's decider loss and
  label generator are training settings hf_loops does not carry);
- `iter_decider_kwargs` (`Qwen3MLPIterDecider`): hidden_size, intermediate_size, topk (the authors' `input_proj` is
  3·hidden_size wide, so topk must equal hidden_size), hidden_act "silu", rms_norm_eps 1e-6, threshold, max_iter,
  dtype (their default is bf16: without it fp32 weights are rounded), uniform_init, stochastic_sampling,
  base_warmup_steps, memory_lean_fp32_reductions; `AlwaysIterDecider`: max_iter, threshold,
  memory_lean_fp32_reductions; `TrivialIterDecider`: max_iter, memory_lean_fp32_reductions (it takes no threshold);
- `input_updater_kwargs` (`Qwen3MLPUpdater`): hidden_size, intermediate_size, hidden_act, rms_norm_eps,
  enable_norm_pre_mlp, enable_norm_out; `IdentityUpdater`: none.
Pass no `tah_config` to their `from_pretrained` (a provided one overrides the saved fields with its defaults).

Reading, every field is honoured or refused: τ follows the authors — `iter_decider_kwargs.threshold` in
`tah_config.json` when present (their loader then skips the `.bin`'s `threshold` buffer; a disagreeing buffer is
reported in a warning), else the buffer; `stochastic_sampling` → `decision_mode="sample"`; `hidden_act` other than
"silu" and `rms_norm_eps` other than 1e-6 (what our updater/decider build) → ValueError; declared sizes must match the
tensors; a decider `max_iter` below `max_iter` caps the depth (as their early exit does); `eval_iter_decider` must be
null or the train decider (a separately built evaluation decider → ValueError); `base_warmup_steps` (a training-only
τ ramp) and the training recipe (losses, label generator) are reported, inference is unaffected; the kernel choices
(attn_implementation, iter_attention_impl, memory_lean_fp32_reductions) compute the same function; unknown fields →
warning.
"""

from __future__ import annotations

import json
import os

import torch
from transformers.utils import logging

from .loop_utils import NON_ARCH_KEYS

logger = logging.get_logger(__name__)

TAH_CONFIG_FILE = "tah_config.json"
DECIDER_FILE = "iter_decider.bin"
UPDATER_FILE = "input_updater.bin"

# official class name → our config value
DECIDER_CLASSES = {"Qwen3MLPIterDecider": "learned", "AlwaysIterDecider": "always", "TrivialIterDecider": "never"}
UPDATER_CLASSES = {"Qwen3MLPUpdater": "learned", "IdentityUpdater": "identity"}
MIXTURES = {"stop_prob_mix": "stop_prob", "even_mix": "even"}
ITERATION_ATTENTION = ("duo", "causal", "same_iter")

# init_args keys we understand; each is honoured, checked or refused in `_decider_fields` / `_updater_fields`
KNOWN_INIT_ARGS = {
    "hidden_size", "intermediate_size", "topk", "k", "top_k", "threshold", "enable_norm_pre_mlp", "enable_norm_out",
    "rms_norm_eps", "eps", "dtype", "torch_dtype", "uniform_init", "vocab_size", "config", "hidden_act", "max_iter",
    "stochastic_sampling", "base_warmup_steps", "memory_lean_fp32_reductions", "learnable_weight",
}
# every TaHConfig field (tah_config.json)
TAH_CONFIG_FIELDS = (
    "embedding_key", "max_iter", "iter_decider", "input_updater", "train_loss", "eval_loss", "eval_iter_decider",
    "iter_label_generator", "iter_attention_mode", "attn_implementation", "iter_attention_impl",
    "weighted_hidden_method", "memory_lean_fp32_reductions", "iter_decider_kwargs", "input_updater_kwargs",
    "train_loss_kwargs", "eval_loss_kwargs", "eval_iter_decider_kwargs", "iter_label_generator_kwargs",
)
TRAINING_FIELDS = ("train_loss", "eval_loss", "iter_label_generator", "train_loss_kwargs", "eval_loss_kwargs",
                   "iter_label_generator_kwargs")
ITER_ATTENTION_IMPLS = ("sdpa", "fa2_hybrid", "triton", "triton_hybrid")
BUILT_HIDDEN_ACT, BUILT_RMS_NORM_EPS = "silu", 1e-6  # what TaH2Updater / TaH2Decider build
DTYPE_NAMES = {torch.float32: "torch.float32", torch.float16: "torch.float16", torch.bfloat16: "torch.bfloat16"}
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")


def is_official_tah2_dir(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), TAH_CONFIG_FILE))


def _class_name(obj) -> str:
    if isinstance(obj, str):
        return obj.rsplit(".", 1)[-1]
    if isinstance(obj, dict) and "__type__" in obj:  # tah_config.json's serialisation of a class
        if "__name__" in obj:  # the authors' form: {"__type__": true, "__module__": ..., "__name__": ...}
            return str(obj["__name__"])
        return str(obj["__type__"]).rsplit(".", 1)[-1]
    if isinstance(obj, type):
        return obj.__name__
    raise ValueError(f"official TaH2 component: cannot read the class name from {obj!r}")


def load_component(path: str, allow_pickle: bool = False) -> dict:
    """Read an official `.bin` component dict. `weights_only=True` first; pickle only with `allow_pickle=True`."""
    if not os.path.isfile(path):
        raise ValueError(f"official TaH2 checkpoint: {os.path.basename(path)} is missing in {os.path.dirname(path)!r}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        if not allow_pickle:
            raise ValueError(
                f"{path!r} cannot be loaded with torch.load(weights_only=True) ({type(err).__name__}: {err}); "
                "pass allow_pickle=True to load it with full pickle, which executes code from the file — only for "
                "files you trust"
            ) from err
        blob = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(blob, dict) or not {"class", "state_dict"} <= set(blob):
        raise ValueError(f"{path!r} is not an official TaH2 component (expected a dict with 'class', 'init_args', "
                         f"'state_dict'), got {type(blob).__name__}")
    return blob


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"official TaH2 checkpoint: {os.path.basename(path)} is missing in {os.path.dirname(path)!r}")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f"line {err.lineno}, column {err.colno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else err.reason
        raise ValueError(f"{path!r}: invalid JSON at {where}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path!r}: expected a JSON object {{...}}, got a JSON {type(value).__name__}")
    return value


def _flag(init_args: dict, key: str, state: dict, state_key: str) -> bool:
    if key in init_args:
        return bool(init_args[key])
    return state_key in state


def _warn_unknown(kind: str, init_args: dict) -> None:
    unknown = sorted(set(init_args) - KNOWN_INIT_ARGS)
    if unknown:
        logger.warning(f"official TaH2 {kind}: ignoring unrecognised init_args {unknown}")


def threshold_value(stored, declared=None) -> float:
    """τ from the decider's `threshold` buffer without a precision loss: `declared` (the init_args value) when the
    buffer holds exactly it, else the shortest decimal the buffer's dtype stores as the same number (0.3 for a float32
    buffer holding 0.30000001; a float64 buffer, as `export_tah2` writes, gives its exact value)."""
    t = torch.as_tensor(stored).reshape(-1)[0]
    if not t.is_floating_point():
        t = t.double()

    def held(x: float) -> bool:
        return bool(torch.tensor(x, dtype=t.dtype) == t)

    if isinstance(declared, (int, float)) and not isinstance(declared, bool) and held(float(declared)):
        return float(declared)
    value = float(t.double().item())
    for digits in range(1, 18):
        shortest = float(f"{value:.{digits}g}")
        if held(shortest):
            return shortest
    return value


def _dtype_of(value):
    """A torch dtype from the forms the authors' files hold (torch.dtype, {"__dtype__": ..., "__str__": ...}, str)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, dict):
        value = value.get("__str__", value.get("__dtype__"))
    if isinstance(value, str):
        found = getattr(torch, value.rsplit(".", 1)[-1], None)
        if isinstance(found, torch.dtype):
            return found
    return None


def _backbone_fields(path: str, qwen: dict) -> dict:
    """Qwen3 fields of `config.json`; the legacy rotary keys (written for transformers 4.x beside `rope_parameters`)
    must agree with `rope_parameters` and are then dropped (transformers 5 reads `rope_parameters`)."""
    kw = {k: v for k, v in qwen.items() if k not in NON_ARCH_KEYS}
    rope = kw.get("rope_parameters")
    if isinstance(rope, dict) and any(k in kw for k in LEGACY_ROPE_KEYS):
        legacy = _legacy_rope(rope)
        for key in LEGACY_ROPE_KEYS:
            if key in kw and kw[key] != legacy[key]:
                raise ValueError(f"official TaH2 checkpoint {path!r}: config.json's {key} {kw[key]!r} disagrees with "
                                 f"rope_parameters {rope!r} (expected {legacy[key]!r})")
            kw.pop(key, None)
    return kw


def _check_tah_fields(tah: dict) -> None:
    """Report what `tah_config.json` holds that the model does not carry; refuse what it cannot honour."""
    unknown = sorted(set(tah) - set(TAH_CONFIG_FIELDS))
    if unknown:
        logger.warning(f"official TaH2 {TAH_CONFIG_FILE}: ignoring unrecognised fields {unknown}")
    key = tah.get("embedding_key", "model.embed_tokens")
    if key != "model.embed_tokens":
        raise ValueError(f"{TAH_CONFIG_FILE}: embedding_key must be 'model.embed_tokens' (the Qwen3 embedding), "
                         f"got {key!r}")
    impl = tah.get("iter_attention_impl", "sdpa")
    if impl not in ITER_ATTENTION_IMPLS:
        logger.warning(f"official TaH2 {TAH_CONFIG_FILE}: unknown iter_attention_impl {impl!r} "
                       f"(known: {list(ITER_ATTENTION_IMPLS)}); the attention kernel does not change the result")
    _check_eval_decider(tah)
    recipe = {k: tah[k] for k in TRAINING_FIELDS if tah.get(k) not in (None, {}, "")}
    if recipe:
        logger.info(f"official TaH2 {TAH_CONFIG_FILE}: the training recipe {recipe} is not part of the model (hf_loops "
                    "trains with its own TaH2 trainer settings); inference is unaffected")


def _check_eval_decider(tah: dict) -> None:
    """The authors evaluate with `eval_iter_decider` (None = the train decider). hf_loops runs one decider: accept
    None or a path to the train decider; refuse a separately built evaluation decider."""
    spec = tah.get("eval_iter_decider")
    if isinstance(spec, (list, tuple)):  # the first entry that resolves wins; every non-None entry resolves
        spec = next((s for s in spec if s is not None), None)
    if spec is None or (isinstance(spec, str) and spec.startswith(("iter_decider", "self.iter_decider"))):
        return
    raise ValueError(
        f"{TAH_CONFIG_FILE}: eval_iter_decider {spec!r} builds a separate decider for evaluation; hf_loops runs the "
        "checkpoint's one decider (supported: null or 'iter_decider'). Load with decider='always' / 'never' to run "
        "a fixed depth instead"
    )


def official_tah2_config_kwargs(path, allow_pickle: bool = False) -> tuple[dict, dict, dict]:
    """(config kwargs for TaH2Config, decider state dict, updater state dict) of an official TaH2 directory."""
    kw, dec_state, upd_state, _ = _official_parts(path, allow_pickle)
    return kw, dec_state, upd_state


def _official_parts(path, allow_pickle: bool = False) -> tuple[dict, dict, dict, dict]:
    """`official_tah2_config_kwargs` plus what applies to the built model rather than its config: the declared
    decider dtype (`decider_dtype`) and whether the authors freeze the updater (`freeze_updater`)."""
    path = os.fspath(path)
    qwen = _read_json(os.path.join(path, "config.json"))
    if qwen.get("model_type") != "qwen3":
        raise ValueError(
            f"official TaH2 checkpoint {path!r}: config.json must describe a plain Qwen3 model (model_type 'qwen3'), "
            f"found model_type {qwen.get('model_type')!r}"
        )
    tah = _read_json(os.path.join(path, TAH_CONFIG_FILE))
    _check_tah_fields(tah)
    kw = _backbone_fields(path, qwen)
    d = kw["hidden_size"]

    max_iter = tah.get("max_iter")
    max_iter = 2 if max_iter is None else max_iter
    mode = tah.get("iter_attention_mode", "causal")
    if mode not in ITERATION_ATTENTION:
        raise ValueError(f"tah_config.json: iter_attention_mode must be one of {list(ITERATION_ATTENTION)}, got {mode!r}")
    method = tah.get("weighted_hidden_method", "stop_prob_mix")
    if method not in MIXTURES:
        raise ValueError(f"tah_config.json: weighted_hidden_method must be one of {list(MIXTURES)}, got {method!r}")
    kw.update(max_iterations=int(max_iter), iteration_attention=mode, mixture=MIXTURES[method])
    dec_state = _decider_fields(kw, path, tah, d, allow_pickle)
    upd_state = _updater_fields(kw, path, tah, d, allow_pickle)
    notes = {"decider_dtype": kw.pop("_official_decider_dtype", None),
             "freeze_updater": kw.pop("_official_freeze_updater", False)}
    return kw, dec_state, upd_state, notes


def _check_built_as_ours(kind: str, args: dict) -> None:
    """Our updater/decider use SiLU and RMSNorm eps 1e-6: refuse a component built otherwise."""
    act = args.get("hidden_act", BUILT_HIDDEN_ACT)
    if act != BUILT_HIDDEN_ACT:
        raise ValueError(f"official TaH2 {kind}: hidden_act must be {BUILT_HIDDEN_ACT!r} (the activation hf_loops "
                         f"builds), got {act!r}")
    for key in ("rms_norm_eps", "eps"):
        eps = args.get(key, BUILT_RMS_NORM_EPS)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or float(eps) != BUILT_RMS_NORM_EPS:
            raise ValueError(f"official TaH2 {kind}: {key} must be {BUILT_RMS_NORM_EPS} (the RMSNorm eps hf_loops "
                             f"builds), got {eps!r}")


def _check_declared_size(kind: str, args: dict, key: str, actual: int) -> None:
    if key in args and args[key] is not None and int(args[key]) != actual:
        raise ValueError(f"official TaH2 {kind}: {key} {args[key]!r} disagrees with the stored weights ({actual})")


def _read_component(path: str, file: str, tah: dict, class_key: str, weightless, allow_pickle: bool) -> dict:
    """The component dict of `file`, or one built from tah_config.json for a weightless class without a file."""
    comp_file = os.path.join(path, file)
    if os.path.isfile(comp_file) or _class_name(tah.get(class_key) or "Qwen3MLP") not in weightless:
        return load_component(comp_file, allow_pickle)
    return {"class": tah[class_key], "init_args": {}, "state_dict": {}}


def _component(path: str, file: str, tah: dict, key: str, classes: dict, weightless: tuple, allow_pickle: bool):
    """(class name, the `.bin`'s init_args, tah_config.json's `<key>_kwargs`, state dict) of the component `key`
    (iter_decider / input_updater), its class known and agreeing with tah_config.json; unknown arguments warned."""
    comp = _read_component(path, file, tah, key, weightless, allow_pickle)
    cls = _class_name(comp["class"])
    if cls not in classes:
        raise ValueError(f"{key}: unknown component class {cls!r}; known: {sorted(classes)}")
    if tah.get(key) is not None and _class_name(tah[key]) != cls:
        raise ValueError(f"official TaH2 checkpoint: {TAH_CONFIG_FILE} names {key} {_class_name(tah[key])!r} but "
                         f"{file} holds a {cls}")
    bin_args, tah_args = dict(comp.get("init_args") or {}), dict(tah.get(f"{key}_kwargs") or {})
    _warn_unknown(key, {**bin_args, **tah_args})
    return cls, bin_args, tah_args, dict(comp["state_dict"])


def _projection_and_gate(state: dict, file: str, projection: str):
    """The two weights a learned component's shapes are read from: its input projection and its MLP's gate."""
    proj, gate = state.get(projection), state.get("mlp.gate_proj.weight")
    if proj is None or gate is None:
        raise ValueError(f"{file}: state_dict lacks {projection} / mlp.gate_proj.weight")
    return proj, gate


def _decider_threshold(kw: dict, tah_args: dict, bin_args: dict, buffer) -> None:
    """τ as the authors' loader takes it: tah_config.json's `iter_decider_kwargs.threshold` when given (their loader
    then skips the `.bin`'s buffer), else the buffer, else the `.bin`'s init_args."""
    declared = tah_args.get("threshold")
    if declared is not None:
        tau = float(declared)
        if buffer is not None and threshold_value(buffer, tau) != tau:
            logger.warning(
                f"official TaH2 {DECIDER_FILE}: the stored threshold buffer ({threshold_value(buffer)}) disagrees with "
                f"{TAH_CONFIG_FILE}'s iter_decider_kwargs.threshold ({tau}); following {TAH_CONFIG_FILE}, as the "
                "authors' loader does"
            )
        kw["exit_threshold"] = tau
    elif buffer is not None:
        kw["exit_threshold"] = threshold_value(buffer, bin_args.get("threshold"))
    elif bin_args.get("threshold") is not None:
        kw["exit_threshold"] = float(bin_args["threshold"])


def _decider_fields(kw: dict, path: str, tah: dict, d: int, allow_pickle: bool) -> dict:
    """Set the decider's TaH2Config fields in `kw` from `iter_decider.bin` and tah_config.json's
    `iter_decider_kwargs` (which wins, as in the authors' loader); return the decider's state dict."""
    dec_cls, bin_args, tah_args, dec_state = _component(path, DECIDER_FILE, tah, "iter_decider", DECIDER_CLASSES,
                                                        ("AlwaysIterDecider", "TrivialIterDecider"), allow_pickle)
    args = {**bin_args, **tah_args}
    kw["decider"] = DECIDER_CLASSES[dec_cls]
    _decider_threshold(kw, tah_args, bin_args, dec_state.pop("threshold", None))
    cap = tah_args.get("max_iter")
    if cap is not None and int(cap) < kw["max_iterations"]:
        logger.warning(f"official TaH2 {TAH_CONFIG_FILE}: iter_decider_kwargs.max_iter {cap} < max_iter "
                       f"{kw['max_iterations']}: the decider stops every token at depth {cap}; max_iterations = {cap}")
        kw["max_iterations"] = int(cap)
    if kw["decider"] == "learned":
        _check_built_as_ours("iter_decider", args)
        proj, gate = _projection_and_gate(dec_state, DECIDER_FILE, "input_proj.weight")
        if proj.shape[0] != d or proj.shape[1] <= 2 * d:
            raise ValueError(
                f"{DECIDER_FILE}: input_proj.weight has shape {tuple(proj.shape)}, expected ({d}, 2·{d} + k) for "
                f"hidden_size {d}"
            )
        kw["decider_topk"] = int(proj.shape[1] - 2 * d)
        kw["decider_intermediate_size"] = int(gate.shape[0])
        for key, actual in (("hidden_size", d), ("intermediate_size", kw["decider_intermediate_size"]),
                            ("topk", kw["decider_topk"])):
            _check_declared_size("iter_decider", args, key, actual)
        if bool(args.get("stochastic_sampling", False)):
            kw["decision_mode"] = "sample"  # their decider samples Bernoulli(g) instead of thresholding
        if int(args.get("base_warmup_steps") or 0) > 0:
            logger.warning(f"official TaH2 iter_decider: base_warmup_steps={args['base_warmup_steps']} ramps τ from 0 "
                           "during the authors' training only; inference is unaffected, hf_loops training does not "
                           "ramp τ")
    elif dec_state:
        raise ValueError(f"{DECIDER_FILE}: a {dec_cls} has no weights, found {sorted(dec_state)[:5]}")
    if kw["decider"] == "learned":  # the authors' Qwen3MLPIterDecider defaults to bf16
        kw["_official_decider_dtype"] = _dtype_of(args.get("dtype", args.get("torch_dtype"))) or torch.bfloat16  # compared with the loaded model's dtype in load_official_tah2
    return dec_state


def _updater_fields(kw: dict, path: str, tah: dict, d: int, allow_pickle: bool) -> dict:
    """Set the updater's TaH2Config fields in `kw` from `input_updater.bin` and tah_config.json's
    `input_updater_kwargs` (the authors build from these when given, else from the `.bin`'s init_args); return the
    updater's state dict."""
    upd_cls, bin_args, tah_args, upd_state = _component(path, UPDATER_FILE, tah, "input_updater", UPDATER_CLASSES,
                                                        ("IdentityUpdater",), allow_pickle)
    args = {**bin_args, **tah_args}
    kw["updater"] = UPDATER_CLASSES[upd_cls]
    if kw["updater"] == "learned":
        _check_built_as_ours("input_updater", args)
        proj, gate = _projection_and_gate(upd_state, UPDATER_FILE, "projection.weight")
        if tuple(proj.shape) != (d, 2 * d):
            raise ValueError(
                f"{UPDATER_FILE}: projection.weight has shape {tuple(proj.shape)}, expected ({d}, {2 * d}) for "
                f"hidden_size {d}"
            )
        kw["updater_intermediate_size"] = int(gate.shape[0])
        for key, actual in (("hidden_size", d), ("intermediate_size", kw["updater_intermediate_size"])):
            _check_declared_size("input_updater", args, key, actual)
        kw["updater_norm_pre_mlp"] = _flag(args, "enable_norm_pre_mlp", upd_state, "norm_pre_mlp.weight")
        kw["updater_norm_out"] = _flag(args, "enable_norm_out", upd_state, "norm_out.weight")
        learnable = args.get("learnable_weight")
        if learnable is False or (isinstance(learnable, str) and learnable.strip().lower() in ("false", "0", "no")):
            kw["_official_freeze_updater"] = True  # the authors freeze the updater's parameters
    elif upd_state:
        raise ValueError(f"{UPDATER_FILE}: a {upd_cls} has no weights, found {sorted(upd_state)[:5]}")
    return upd_state


def _load_part(module, state: dict, name: str) -> None:
    target = module.state_dict()
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    mismatched = [f"{k}: {tuple(state[k].shape)} vs {tuple(target[k].shape)}"
                  for k in sorted(set(state) & set(target)) if tuple(state[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or mismatched:
        raise ValueError(f"{name}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, "
                         f"mismatched shapes {mismatched[:5]}")
    with torch.no_grad():
        for k, v in state.items():
            target[k].copy_(v.to(target[k].dtype))


def load_official_tah2(config_cls, backbone_loader, path, allow_pickle: bool = False, **kwargs):
    """Build a `TaH2ForCausalLM` from an official directory.

    `backbone_loader(path, config=..., output_loading_info=True, **kwargs)` loads the Qwen3 weights key-preserving
    (it is `PreTrainedModel.from_pretrained` of the TaH2 class). Keyword arguments that name config fields override
    the values read from the checkpoint (e.g. `max_iterations=4`); the rest go to the backbone loader.
    """
    path = os.fspath(path)
    cfg_kw, dec_state, upd_state, notes = _official_parts(path, allow_pickle=allow_pickle)
    want_info = kwargs.pop("output_loading_info", False)
    kwargs.pop("config", None)
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in config_cls.__annotations__}
    cfg_kw.update(overrides)
    config = config_cls(**cfg_kw)
    previous = logging.get_verbosity()
    logging.set_verbosity_error()  # updater/decider are expected to be missing here (loaded below); checked below
    try:
        model, info = backbone_loader(path, config=config, output_loading_info=True, **kwargs)
    except (OSError, RuntimeError) as err:  # missing weight files (OSError), shape mismatches (RuntimeError)
        raise ValueError(f"official TaH2 checkpoint {path!r}: could not load the Qwen3 weights: {err}") from err
    finally:
        logging.set_verbosity(previous)
    bad_missing = [k for k in info["missing_keys"] if not k.startswith(("updater.", "decider."))]
    if info["unexpected_keys"] or bad_missing or info.get("mismatched_keys"):
        raise ValueError(
            f"official TaH2 checkpoint {path!r}: the Qwen3 weights do not match the config: unexpected keys "
            f"{list(info['unexpected_keys'])[:5]}, missing keys {bad_missing[:5]}, mismatched shapes "
            f"{list(info.get('mismatched_keys') or [])[:5]}"
        )
    if model.decider is not None:
        _load_part(model.decider, dec_state, DECIDER_FILE)
    if model.updater is not None:
        _load_part(model.updater, upd_state, UPDATER_FILE)
        if notes["freeze_updater"]:  # init_args learnable_weight=False: the authors train with the updater frozen
            model.updater.requires_grad_(False)
    if model.decider is not None and notes["decider_dtype"] not in (None, model.decider.score.weight.dtype):
        logger.warning(f"official TaH2 {DECIDER_FILE}: the authors run the decider in {notes['decider_dtype']}, this "
                       f"model in {model.decider.score.weight.dtype} (pass dtype=... to match): decisions can differ "
                       "where the continue probability is within rounding of τ")
    model.eval()
    if want_info:
        info = dict(info, missing_keys=bad_missing)
        return model, info
    return model


# ----------------------------------------------------------------------------------------------------------------------
# Writing the layout (the other direction; `hf_loops.conversion.export_tah2` adds the atomic output directory)
# ----------------------------------------------------------------------------------------------------------------------

# our config value → official class name
DECIDER_NAMES = {v: k for k, v in DECIDER_CLASSES.items()}
UPDATER_NAMES = {v: k for k, v in UPDATER_CLASSES.items()}
MIXTURE_NAMES = {v: k for k, v in MIXTURES.items()}


def _architecture_fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in NON_ARCH_KEYS}


def _tah2_only_fields(config) -> set[str]:
    return set(type(config).__annotations__)


def _legacy_rope(rope_parameters: dict) -> dict:
    """transformers 4.x's form of `rope_parameters`: `rope_theta` plus `rope_scaling` (None for the default rope)."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        scaling = None
    return {"rope_theta": rope_parameters.get("rope_theta"), "rope_scaling": scaling}


def _decider_dtype(model):
    if model.decider is None:
        return None
    return model.decider.score.weight.dtype


def check_official_equivalents(config, model=None) -> None:
    """The official layout has no form for some of our settings: say which, before anything is written."""
    for field, names in (("updater", UPDATER_NAMES), ("decider", DECIDER_NAMES), ("mixture", MIXTURE_NAMES)):
        if getattr(config, field) not in names:
            raise ValueError(f"export_tah2: {field} {getattr(config, field)!r} has no official equivalent "
                             f"(official: {sorted(names)})")
    if config.decider == "learned" and config.decider_topk != config.hidden_size:
        raise ValueError(f"export_tah2: decider_topk must equal hidden_size ({config.hidden_size}) for the authors' "
                         f"Qwen3MLPIterDecider (its input_proj is 3·hidden_size wide), got {config.decider_topk}")
    if model is not None and _decider_dtype(model) not in (None, *DTYPE_NAMES):
        raise ValueError(f"export_tah2: the decider's dtype must be one of {sorted(DTYPE_NAMES.values())} (what the "
                         f"authors' tah_config.json can name), got {_decider_dtype(model)}")


def _official_tah_config(model) -> dict:
    """tah_config.json: every TaHConfig field stated (the authors' loader lets missing ones default)."""
    cfg = model.config
    dec_cls, upd_cls = DECIDER_NAMES[cfg.decider], UPDATER_NAMES[cfg.updater]
    return {
        "embedding_key": "model.embed_tokens",
        "max_iter": cfg.max_iterations,
        "iter_decider": dec_cls,
        "input_updater": upd_cls,
        "train_loss": "NextTokenPredLoss",
        "eval_loss": "NextTokenPredLoss",
        "eval_iter_decider": None,
        "iter_label_generator": None,
        "iter_attention_mode": cfg.iteration_attention,
        "attn_implementation": "sdpa",
        "iter_attention_impl": "sdpa",
        "weighted_hidden_method": MIXTURE_NAMES[cfg.mixture],
        "memory_lean_fp32_reductions": False,
        "iter_decider_kwargs": _decider_args(model, json_form=True),
        "input_updater_kwargs": _updater_args(model),
        "train_loss_kwargs": {},
        "eval_loss_kwargs": {},
        "eval_iter_decider_kwargs": {},
        "iter_label_generator_kwargs": {},
    }


def _decider_args(model, json_form: bool) -> dict:
    """The decider's constructor arguments, as the authors' classes take them (dtype as tah_config.json serialises
    a torch dtype when `json_form`, else the torch.dtype their `.bin` init_args hold)."""
    cfg = model.config
    args = {"max_iter": cfg.max_iterations, "memory_lean_fp32_reductions": False}
    if cfg.decider == "never":  # TrivialIterDecider takes no threshold
        return args
    args["threshold"] = cfg.exit_threshold
    if cfg.decider == "learned":
        dtype = _decider_dtype(model)
        args.update(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.decider_intermediate_size, topk=cfg.decider_topk,
            hidden_act=BUILT_HIDDEN_ACT, rms_norm_eps=BUILT_RMS_NORM_EPS,
            dtype={"__dtype__": True, "__str__": DTYPE_NAMES[dtype]} if json_form else dtype,
            uniform_init=False, stochastic_sampling=cfg.decision_mode == "sample", base_warmup_steps=0,
        )
    return dict(sorted(args.items()))


def _updater_args(model) -> dict:
    cfg = model.config
    if cfg.updater != "learned":
        return {}
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.updater_intermediate_size,
            "hidden_act": BUILT_HIDDEN_ACT, "rms_norm_eps": BUILT_RMS_NORM_EPS,
            "enable_norm_pre_mlp": cfg.updater_norm_pre_mlp, "enable_norm_out": cfg.updater_norm_out}


def qwen3_backbone(model, drop: tuple[str, ...] = ("updater.", "decider.")):
    """The plain `Qwen3ForCausalLM` inside a TaH2ForCausalLM: the same tensors (no copy) under the same names, in a
    Qwen3ForCausalLM built on meta from the architecture fields of `model.config` (its TaH2 loop fields left out),
    the rotary buffers and generation config taken over. Parameters under the `drop` prefixes are left out; every other
    one must fill the Qwen3 model exactly (a strict load: no key missing, none left over)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    fields = {k: v for k, v in _architecture_fields(cfg).items() if k not in _tah2_only_fields(cfg)}
    qcfg = Qwen3Config(**fields)
    with torch.device("meta"):
        qwen = Qwen3ForCausalLM(qcfg)
    backbone = {k: v for k, v in model.state_dict().items() if not k.startswith(drop)}
    if qcfg.tie_word_embeddings:
        backbone.pop("lm_head.weight", None)
    missing, unexpected = qwen.load_state_dict(backbone, strict=False, assign=True)
    missing = [k for k in missing if not (qcfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"the TaH2 model's parameters do not match a Qwen3ForCausalLM: missing {missing[:5]}, "
                         f"left over {unexpected[:5]}")
    if qcfg.tie_word_embeddings:
        qwen.tie_weights()
    own = dict(model.named_buffers())
    for name, buf in list(qwen.named_buffers()):  # non-persistent (RoPE frequencies): not in the state dict
        if buf.is_meta and name in own:
            module, _, attr = name.rpartition(".")
            qwen.get_submodule(module)._buffers[attr] = own[name]
    left = [n for n, t in list(qwen.named_parameters()) + list(qwen.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the TaH2 model does not fill a Qwen3ForCausalLM: {left[:5]} have no tensor")
    qwen.generation_config = model.generation_config
    return qwen.train(model.training)


def _write_backbone(model, directory: str) -> None:
    """The plain Qwen3 backbone (`qwen3_backbone`), with `config.json` also carrying transformers 4.x's rotary keys."""
    qwen = qwen3_backbone(model)
    qwen.save_pretrained(directory)
    config_file = os.path.join(directory, "config.json")
    with open(config_file, encoding="utf-8") as f:
        written = json.load(f)
    if isinstance(written.get("rope_parameters"), dict):
        written.update(_legacy_rope(written["rope_parameters"]))
    with open(config_file, "w", encoding="utf-8") as f:
        f.write(json.dumps(written, indent=2, sort_keys=True) + "\n")


def write_official_tah2(model, directory: str, tokenizer=None) -> None:
    """Write `model` (a TaH2ForCausalLM) into the existing `directory` in the official layout: the plain Qwen3
    backbone, `tah_config.json` and the two components, every field the authors' loader reads stated (see the module
    docstring). Reading it back (`load_official_tah2`) is bit-identical."""
    cfg = model.config
    check_official_equivalents(cfg, model)
    _write_backbone(model, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, TAH_CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(_official_tah_config(model), f, indent=2)
        f.write("\n")

    dec_state = {}
    if model.decider is not None:
        dec_state = {k: v.detach().clone() for k, v in model.decider.state_dict().items()}
    dec_state["threshold"] = torch.tensor(cfg.exit_threshold, dtype=torch.float64)  # exact τ round trip
    torch.save({"class": DECIDER_NAMES[cfg.decider], "init_args": _decider_args(model, json_form=False),
                "state_dict": dec_state}, os.path.join(directory, DECIDER_FILE))
    upd_state = {}
    if model.updater is not None:
        upd_state = {k: v.detach().clone() for k, v in model.updater.state_dict().items()}
    torch.save({"class": UPDATER_NAMES[cfg.updater], "init_args": _updater_args(model), "state_dict": upd_state},
               os.path.join(directory, UPDATER_FILE))
