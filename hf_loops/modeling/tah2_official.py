"""Loading a TaH2 checkpoint released in the authors' layout (spec: shared/specs/tah2.md §8).

The official layout is a plain Qwen3 checkpoint (`config.json` with model_type "qwen3" + weights) plus
`tah_config.json` (the loop settings) and two `torch.save` dicts, `iter_decider.bin` and `input_updater.bin`, each
`{"class": <name>, "init_args": {...}, "state_dict": {...}}`. Our updater/decider use the official submodule names,
so the import is a prefix rename; the decider's `threshold` buffer becomes `config.exit_threshold`.

`TaH2ForCausalLM.from_pretrained(dir)` calls `load_official_tah2` when `dir/tah_config.json` exists. This file ships
as Hub remote code next to modeling_tah2.py: it imports only the standard library, torch and transformers.
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

# init_args keys we understand (sizes are read from the tensor shapes; only the norm switches change semantics)
KNOWN_INIT_ARGS = {
    "hidden_size", "intermediate_size", "topk", "k", "top_k", "threshold", "enable_norm_pre_mlp", "enable_norm_out",
    "rms_norm_eps", "eps", "dtype", "torch_dtype", "uniform_init", "vocab_size", "config",
}



def is_official_tah2_dir(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), TAH_CONFIG_FILE))


def _class_name(obj) -> str:
    if isinstance(obj, str):
        return obj.rsplit(".", 1)[-1]
    if isinstance(obj, dict) and "__type__" in obj:  # tah_config.json's serialisation of a class
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
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError and others
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


def official_tah2_config_kwargs(path, allow_pickle: bool = False) -> tuple[dict, dict, dict]:
    """(config kwargs for TaH2Config, decider state dict, updater state dict) of an official TaH2 directory."""
    path = os.fspath(path)
    qwen = _read_json(os.path.join(path, "config.json"))
    if qwen.get("model_type") != "qwen3":
        raise ValueError(
            f"official TaH2 checkpoint {path!r}: config.json must describe a plain Qwen3 model (model_type 'qwen3'), "
            f"found model_type {qwen.get('model_type')!r}"
        )
    tah = _read_json(os.path.join(path, TAH_CONFIG_FILE))
    kw = {k: v for k, v in qwen.items() if k not in NON_ARCH_KEYS}
    d = kw["hidden_size"]

    max_iter = tah.get("max_iter", 2)
    mode = tah.get("iter_attention_mode", "causal")
    if mode not in ITERATION_ATTENTION:
        raise ValueError(f"tah_config.json: iter_attention_mode must be one of {list(ITERATION_ATTENTION)}, got {mode!r}")
    method = tah.get("weighted_hidden_method", "stop_prob_mix")
    if method not in MIXTURES:
        raise ValueError(f"tah_config.json: weighted_hidden_method must be one of {list(MIXTURES)}, got {method!r}")
    kw.update(max_iterations=int(max_iter), iteration_attention=mode, mixture=MIXTURES[method])
    dec_state = _decider_fields(kw, path, tah, d, allow_pickle)
    upd_state = _updater_fields(kw, path, tah, d, allow_pickle)
    return kw, dec_state, upd_state


def _decider_fields(kw: dict, path: str, tah: dict, d: int, allow_pickle: bool) -> dict:
    """Set the decider's TaH2Config fields in `kw` from `iter_decider.bin` (or tah_config.json for weightless
    deciders); return the decider's state dict."""
    dec_file = os.path.join(path, DECIDER_FILE)
    if os.path.isfile(dec_file) or _class_name(tah.get("iter_decider", "Qwen3MLPIterDecider")) not in (
        "AlwaysIterDecider", "TrivialIterDecider"
    ):
        dec = load_component(dec_file, allow_pickle)
    else:
        dec = {"class": tah["iter_decider"], "init_args": tah.get("iter_decider_kwargs") or {}, "state_dict": {}}
    dec_cls = _class_name(dec["class"])
    if dec_cls not in DECIDER_CLASSES:
        raise ValueError(f"iter_decider: unknown component class {dec_cls!r}; known: {sorted(DECIDER_CLASSES)}")
    dec_args, dec_state = dict(dec.get("init_args") or {}), dict(dec["state_dict"])
    _warn_unknown("iter_decider", dec_args)
    kw["decider"] = DECIDER_CLASSES[dec_cls]
    threshold = dec_state.pop("threshold", None)
    if threshold is not None:
        kw["exit_threshold"] = threshold_value(threshold, dec_args.get("threshold"))
    elif "threshold" in dec_args:
        kw["exit_threshold"] = float(dec_args["threshold"])
    if kw["decider"] == "learned":
        proj = dec_state.get("input_proj.weight")
        gate = dec_state.get("mlp.gate_proj.weight")
        if proj is None or gate is None:
            raise ValueError(f"{DECIDER_FILE}: state_dict lacks input_proj.weight / mlp.gate_proj.weight")
        if proj.shape[0] != d or proj.shape[1] <= 2 * d:
            raise ValueError(
                f"{DECIDER_FILE}: input_proj.weight has shape {tuple(proj.shape)}, expected ({d}, 2·{d} + k) for "
                f"hidden_size {d}"
            )
        kw["decider_topk"] = int(proj.shape[1] - 2 * d)
        kw["decider_intermediate_size"] = int(gate.shape[0])
    elif dec_state:
        raise ValueError(f"{DECIDER_FILE}: a {dec_cls} has no weights, found {sorted(dec_state)[:5]}")
    return dec_state


def _updater_fields(kw: dict, path: str, tah: dict, d: int, allow_pickle: bool) -> dict:
    """Set the updater's TaH2Config fields in `kw` from `input_updater.bin` (or tah_config.json for the identity
    updater); return the updater's state dict."""
    upd_file = os.path.join(path, UPDATER_FILE)
    if os.path.isfile(upd_file) or _class_name(tah.get("input_updater", "Qwen3MLPUpdater")) != "IdentityUpdater":
        upd = load_component(upd_file, allow_pickle)
    else:
        upd = {"class": tah["input_updater"], "init_args": tah.get("input_updater_kwargs") or {}, "state_dict": {}}
    upd_cls = _class_name(upd["class"])
    if upd_cls not in UPDATER_CLASSES:
        raise ValueError(f"input_updater: unknown component class {upd_cls!r}; known: {sorted(UPDATER_CLASSES)}")
    upd_args, upd_state = dict(upd.get("init_args") or {}), dict(upd["state_dict"])
    _warn_unknown("input_updater", upd_args)
    kw["updater"] = UPDATER_CLASSES[upd_cls]
    if kw["updater"] == "learned":
        proj = upd_state.get("projection.weight")
        gate = upd_state.get("mlp.gate_proj.weight")
        if proj is None or gate is None:
            raise ValueError(f"{UPDATER_FILE}: state_dict lacks projection.weight / mlp.gate_proj.weight")
        if tuple(proj.shape) != (d, 2 * d):
            raise ValueError(
                f"{UPDATER_FILE}: projection.weight has shape {tuple(proj.shape)}, expected ({d}, {2 * d}) for "
                f"hidden_size {d}"
            )
        kw["updater_intermediate_size"] = int(gate.shape[0])
        kw["updater_norm_pre_mlp"] = _flag(upd_args, "enable_norm_pre_mlp", upd_state, "norm_pre_mlp.weight")
        kw["updater_norm_out"] = _flag(upd_args, "enable_norm_out", upd_state, "norm_out.weight")
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
    cfg_kw, dec_state, upd_state = official_tah2_config_kwargs(path, allow_pickle=allow_pickle)
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


def check_official_equivalents(config) -> None:
    """The official layout has no form for some of our settings: say which, before anything is written."""
    for field, names in (("updater", UPDATER_NAMES), ("decider", DECIDER_NAMES), ("mixture", MIXTURE_NAMES)):
        if getattr(config, field) not in names:
            raise ValueError(f"export_tah2: {field} {getattr(config, field)!r} has no official equivalent "
                             f"(official: {sorted(names)})")


def write_official_tah2(model, directory: str, tokenizer=None) -> None:
    """Write `model` (a TaH2ForCausalLM) into the existing `directory` in the official layout: the plain Qwen3
    backbone, `tah_config.json` and the two components. Reading it back (`load_official_tah2`) is bit-identical."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    check_official_equivalents(cfg)
    tmp = directory
    # 1) the plain Qwen3 backbone: the same tensors under a Qwen3ForCausalLM (built on meta, no copy)
    fields = {k: v for k, v in _architecture_fields(cfg).items() if k not in _tah2_only_fields(cfg)}
    qcfg = Qwen3Config(**fields)
    with torch.device("meta"):
        qwen = Qwen3ForCausalLM(qcfg)
    backbone = {k: v for k, v in model.state_dict().items() if not k.startswith(("updater.", "decider."))}
    if qcfg.tie_word_embeddings:
        backbone.pop("lm_head.weight", None)
    qwen.load_state_dict(backbone, strict=not qcfg.tie_word_embeddings, assign=True)
    if qcfg.tie_word_embeddings:
        qwen.tie_weights()
    qwen.generation_config = model.generation_config
    qwen.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)

    # 2) tah_config.json
    decider_cls, updater_cls = DECIDER_NAMES[cfg.decider], UPDATER_NAMES[cfg.updater]
    tah = {
        "embedding_key": "model.embed_tokens",
        "max_iter": cfg.max_iterations,
        "iter_attention_mode": cfg.iteration_attention,
        "weighted_hidden_method": MIXTURE_NAMES[cfg.mixture],
        "iter_decider": decider_cls,
        "iter_decider_kwargs": {"threshold": cfg.exit_threshold},
        "input_updater": updater_cls,
        "input_updater_kwargs": {},
    }
    with open(os.path.join(tmp, TAH_CONFIG_FILE), "w") as f:
        json.dump(tah, f, indent=2)

    # 3) the two components
    d = cfg.hidden_size
    dec_state = {}
    dec_args = {"threshold": cfg.exit_threshold}
    if model.decider is not None:
        dec_state = {k: v.detach().clone() for k, v in model.decider.state_dict().items()}
        dec_args.update(hidden_size=d, intermediate_size=cfg.decider_intermediate_size, topk=cfg.decider_topk)
    dec_state["threshold"] = torch.tensor(cfg.exit_threshold, dtype=torch.float64)  # exact τ round trip
    torch.save({"class": decider_cls, "init_args": dec_args, "state_dict": dec_state},
               os.path.join(tmp, DECIDER_FILE))
    upd_state, upd_args = {}, {}
    if model.updater is not None:
        upd_state = {k: v.detach().clone() for k, v in model.updater.state_dict().items()}
        upd_args = {"hidden_size": d, "intermediate_size": cfg.updater_intermediate_size,
                    "enable_norm_pre_mlp": cfg.updater_norm_pre_mlp, "enable_norm_out": cfg.updater_norm_out}
    torch.save({"class": updater_cls, "init_args": upd_args, "state_dict": upd_state},
               os.path.join(tmp, UPDATER_FILE))
