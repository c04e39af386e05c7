"""Qwen3 → looped-model retrofits: a key-preserving load of the Qwen3 weights plus freshly initialised new modules."""

from __future__ import annotations

import json
import os

import torch
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

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
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "qwen3":
        raise ValueError(
            f"convert_qwen3 expects a Qwen3 checkpoint (model_type 'qwen3'); {source_dir!r} has model_type "
            f"{cfg.get('model_type')!r}"
        )
    return cfg


def convert_qwen3(source, arch: str, dtype: torch.dtype | None = None, **config_overrides) -> PreTrainedModel:
    """Convert a Qwen3 causal LM into a looped architecture.

    Args:
        source: a `Qwen3ForCausalLM` instance or a local checkpoint directory of one.
        arch: target architecture (see `hf_loops.conversion.registry.ARCHITECTURES`), e.g. "tah2".
        dtype: optional dtype of the converted model (default: the source's).
        **config_overrides: fields of the target config, e.g. `max_iterations=3, exit_threshold=0.6`.

    Returns the converted model: Qwen3 weights under their own names, new modules freshly initialised.
    """
    config_cls, model_cls = get_architecture(arch)
    if isinstance(source, PreTrainedModel):
        src_type = getattr(source.config, "model_type", None)
        if src_type != "qwen3" or not hasattr(source, "lm_head"):
            raise ValueError(
                f"convert_qwen3 expects a Qwen3ForCausalLM; got {type(source).__name__} (model_type {src_type!r})"
            )
        config = config_cls(**qwen3_config_fields(source.config), **config_overrides)
        src_dtype = next(source.parameters()).dtype
        model = model_cls(config).to(src_dtype)
        state = source.state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        _check_key_report(arch, model, missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
    elif isinstance(source, (str, os.PathLike)):
        source = os.fspath(source)
        if not os.path.isdir(source):
            raise ValueError(
                f"convert_qwen3 source {source!r} is not a local directory (give a Qwen3ForCausalLM or a local "
                "checkpoint directory)"
            )
        cfg = _read_source_config(source)
        config = config_cls(**qwen3_config_fields(cfg), **config_overrides)
        model, info = model_cls.from_pretrained(source, config=config, output_loading_info=True, dtype=dtype or "auto")
        _check_key_report(arch, model, info["missing_keys"], info["unexpected_keys"], info.get("mismatched_keys"))
    else:
        raise ValueError(
            f"convert_qwen3 source must be a Qwen3ForCausalLM or a local directory, got {type(source).__name__}"
        )
    if dtype is not None:
        model = model.to(dtype)
    return model


def _check_key_report(arch, model, missing, unexpected, mismatched=None) -> None:
    new_prefixes = tuple(getattr(model, "_hf_loops_new_module_prefixes", ()))
    bad_missing = [k for k in missing if not k.startswith(new_prefixes)]
    if unexpected or bad_missing or mismatched:
        raise ValueError(
            f"source checkpoint does not match a Qwen3 backbone for arch {arch!r}: "
            f"unexpected keys {list(unexpected)[:5]}, missing keys {bad_missing[:5]}, "
            f"mismatched shapes {list(mismatched or [])[:5]}"
        )
