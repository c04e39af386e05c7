"""Qwen3 → looped-model retrofits: a key-preserving load of the Qwen3 weights plus freshly initialised new modules."""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import PreTrainedModel, Qwen3ForCausalLM
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.utils import logging as hf_logging

from ..modeling.loop_utils import check_known_keys
from ..modeling.tah2_official import is_official_tah2_dir
from .checks import check_safetensors_files, load_tokenizer, read_json_file
from .hub import resolve_source_dir
from .registry import get_architecture

# Keys of a saved config that describe the file rather than the architecture.
_NON_ARCH_KEYS = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype")


def qwen3_config_fields(config: Qwen3Config | dict) -> dict:
    """The architecture fields of a Qwen3 config, ready to pass to a looped config class."""
    d = dict(config) if isinstance(config, dict) else config.to_dict()
    for key in _NON_ARCH_KEYS:
        d.pop(key, None)
    return d


def _read_source_config(source_dir: str) -> dict:
    path = os.path.join(source_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{source_dir!r} is not a checkpoint directory: config.json is missing")
    cfg = read_json_file(path)
    check_safetensors_files(source_dir)
    if cfg.get("model_type") != "qwen3":
        raise ValueError(
            f"convert_qwen3 expects a Qwen3 checkpoint (model_type 'qwen3'); {source_dir!r} has model_type "
            f"{cfg.get('model_type')!r}"
        )
    return cfg


def _load_tokenizer(tokenizer, source_dir: str | None):
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(os.fspath(tokenizer), "tokenizer")
    if source_dir is None or not any(os.path.isfile(os.path.join(source_dir, f))
                                     for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return load_tokenizer(source_dir, "the source's tokenizer")


def load_source_tokenizer(source, tokenizer=None):
    """The tokenizer of a conversion: `tokenizer` (object or path) or the source directory's, else None."""
    source_dir = None
    if isinstance(source, (str, os.PathLike)):
        source_dir = resolve_source_dir(source)
    return _load_tokenizer(tokenizer, source_dir)


def load_qwen3_source(source, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A `Qwen3ForCausalLM` from a model, a local directory or a Hub id (an official TaH2 directory gives its plain
    Qwen3 backbone)."""
    if isinstance(source, PreTrainedModel):
        _check_qwen3_model(source)
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"convert_qwen3 source must be a Qwen3ForCausalLM, a local directory or a Hub id, got {type(source).__name__}"
        )
    source_dir = resolve_source_dir(source)
    _read_source_config(source_dir)
    try:
        return Qwen3ForCausalLM.from_pretrained(source_dir, dtype=dtype or "auto").eval()
    except (RuntimeError, OSError) as err:
        raise ValueError(f"could not load the Qwen3 checkpoint {source_dir!r}: {err}") from err


def _check_qwen3_model(source) -> None:
    src_type = getattr(source.config, "model_type", None)
    if src_type != "qwen3" or not hasattr(source, "lm_head"):
        raise ValueError(
            f"convert_qwen3 expects a Qwen3ForCausalLM; got {type(source).__name__} (model_type {src_type!r})"
        )


@contextlib.contextmanager
def _quiet_loading():
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def cast_model(model, dtype: torch.dtype):
    """`model.to(dtype)`, but the rotary inverse frequencies stay fp32 (recomputed), as `from_pretrained(dtype=...)`
    leaves them for Qwen3: bf16 frequencies would shift every RoPE angle and break parity with the source."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = model.to(dtype)
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "rope_type"):
            if module.rope_type == "default":
                init_fn = module.compute_default_rope_parameters
            else:
                init_fn = ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, _ = init_fn(module.config, device=module.inv_freq.device)
            module.inv_freq = inv_freq.float()
            module.original_inv_freq = inv_freq.float().clone()
    return model


def convert_qwen3(source, arch: str, dtype: torch.dtype | None = None, *, tokenizer=None, calibration=None,
                  layer_map: dict | None = None, core_init: str = "select", allow_pickle: bool = False,
                  seed: int | None = None, **config_overrides) -> PreTrainedModel:
    """Convert a Qwen3 causal LM into a looped architecture.

    Args:
        source: a `Qwen3ForCausalLM` instance, a local checkpoint directory, or a Hub repository id (downloaded with
            `huggingface_hub.snapshot_download`; offline / unreachable → `ValueError`). For `arch="tah2"` a
            directory in the authors' TaH2 layout (`tah_config.json` + `iter_decider.bin` + `input_updater.bin`) is
            imported with its trained updater and decider.
        arch: target architecture (see `hf_loops.conversion.registry.ARCHITECTURES`): "tah2", "spiralformer", "sgt".
        dtype: optional dtype of the converted model (default: the source's).
        tokenizer: tokenizer (or its path) for SGT calibration; default: the source directory's.
        calibration: SGT only: a text file (or list of strings) whose attention entropies choose the loop plan.
        layer_map, core_init: SpiralFormer only: which source layers become pre / core / post (see
            `hf_loops.conversion.spiralformer`); or give `num_pre_layers`/`num_loop_layers`/`num_post_layers`.
        allow_pickle: official TaH2 import only: let the `.bin` components fall back to full pickle.
        seed: the seed of the freshly initialised modules (TaH2's updater and decider, SpiralFormer's routers, ...):
            the same seed gives the same model. They are drawn inside `torch.random.fork_rng`, so the caller's global
            RNG state is left as it was. None (default): drawn from the global torch RNG, as `nn.Module` init does.
        **config_overrides: fields of the target config, e.g. `max_iterations=3, exit_threshold=0.6`.

    Returns the converted model: Qwen3 weights under their own names, new modules freshly initialised.
    """
    if seed is None:
        return _convert_qwen3(source, arch, dtype, tokenizer, calibration, layer_map, core_init, allow_pickle,
                              config_overrides)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _convert_qwen3(source, arch, dtype, tokenizer, calibration, layer_map, core_init, allow_pickle,
                              config_overrides)


def _convert_qwen3(source, arch, dtype, tokenizer, calibration, layer_map, core_init, allow_pickle,
                   config_overrides) -> PreTrainedModel:
    config_cls, model_cls = get_architecture(arch)
    # A misspelt field would otherwise be written verbatim into config.json and silently ignored.
    check_known_keys(config_cls, config_overrides, what="field")
    if arch != "spiralformer" and (layer_map is not None or core_init != "select"):
        raise ValueError("layer_map and core_init apply to arch 'spiralformer' only")
    if arch != "sgt" and calibration is not None:
        raise ValueError("calibration applies to arch 'sgt' only")
    source_dir = None
    if isinstance(source, (str, os.PathLike)):
        source_dir = resolve_source_dir(source)
        if arch == "tah2" and is_official_tah2_dir(source_dir):
            from .tah2_official import import_tah2

            check_safetensors_files(source_dir)
            model = import_tah2(source_dir, allow_pickle=allow_pickle, **config_overrides)
            return cast_model(model, dtype) if dtype is not None else model

    if arch == "spiralformer":
        from .spiralformer import convert_spiralformer

        qwen = load_qwen3_source(source_dir if source_dir is not None else source, dtype=dtype)
        model = convert_spiralformer(qwen, layer_map=layer_map, core_init=core_init, **config_overrides)
    elif isinstance(source, PreTrainedModel):
        _check_qwen3_model(source)
        config = config_cls(**{**qwen3_config_fields(source.config), **config_overrides})
        src_dtype = next(source.parameters()).dtype
        model = cast_model(model_cls(config), src_dtype)
        state = source.state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        _check_key_report(arch, model, missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
    elif source_dir is not None:
        cfg = _read_source_config(source_dir)
        config = config_cls(**{**qwen3_config_fields(cfg), **config_overrides})
        try:
            with _quiet_loading():  # the new modules are expected to be missing; the key report is checked below
                model, info = model_cls.from_pretrained(source_dir, config=config, output_loading_info=True,
                                                        dtype=dtype or "auto")
        except (RuntimeError, OSError) as err:  # shape mismatches (RuntimeError), missing weight files (OSError)
            raise ValueError(f"source checkpoint {source_dir!r} does not match its config.json: {err}") from err
        _check_key_report(arch, model, info["missing_keys"], info["unexpected_keys"], info.get("mismatched_keys"))
    else:
        raise ValueError(
            f"convert_qwen3 source must be a Qwen3ForCausalLM, a local directory or a Hub id, got {type(source).__name__}"
        )
    if dtype is not None:
        model = cast_model(model, dtype)
    if calibration is not None:
        from .sgt import calibrate_sgt

        calibrate_sgt(model, calibration, _load_tokenizer(tokenizer, source_dir))
    return model.eval()


def _check_key_report(arch, model, missing, unexpected, mismatched=None) -> None:
    new_prefixes = tuple(getattr(model, "_hf_loops_new_module_prefixes", ()))
    bad_missing = [k for k in missing if not k.startswith(new_prefixes)]
    if unexpected or bad_missing or mismatched:
        raise ValueError(
            f"source checkpoint does not match a Qwen3 backbone for arch {arch!r}: "
            f"unexpected keys {list(unexpected)[:5]}, missing keys {bad_missing[:5]}, "
            f"mismatched shapes {list(mismatched or [])[:5]}"
        )
