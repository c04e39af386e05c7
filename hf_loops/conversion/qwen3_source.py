"""Qwen3-source helpers every converter shares (a leaf module: it imports no other conversion module): reading and
checking a Qwen3 checkpoint, its config fields, its tokenizer, dtype casting with fp32 rotary frequencies, and the
key report of a key-preserving load."""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import PreTrainedModel, Qwen3ForCausalLM
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.utils import logging as hf_logging

from ..modeling.loop_utils import NON_ARCH_KEYS
from .checks import check_config_json, check_safetensors_files, load_tokenizer
from .hub import resolve_source_dir


def qwen3_config_fields(config: Qwen3Config | dict) -> dict:
    """The architecture fields of a Qwen3 config, ready to pass to a looped config class."""
    d = dict(config) if isinstance(config, dict) else config.to_dict()
    for key in NON_ARCH_KEYS:
        d.pop(key, None)
    return d


def read_source_config(source_dir: str) -> dict:
    """The source checkpoint's config.json (checked, with its weight files), which must be a Qwen3 one."""
    cfg = check_config_json(source_dir)
    check_safetensors_files(source_dir)
    if cfg.get("model_type") != "qwen3":
        raise ValueError(
            f"convert_qwen3 expects a Qwen3 checkpoint (model_type 'qwen3'); {source_dir!r} has model_type "
            f"{cfg.get('model_type')!r}"
        )
    return cfg


def resolve_tokenizer(tokenizer, source_dir: str | None):
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
    return resolve_tokenizer(tokenizer, source_dir)


def load_qwen3_source(source, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A `Qwen3ForCausalLM` from a model, a local directory or a Hub id (an official TaH2 directory gives its plain
    Qwen3 backbone)."""
    if isinstance(source, PreTrainedModel):
        check_qwen3_model(source)
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"convert_qwen3 source must be a Qwen3ForCausalLM, a local directory or a Hub id, got {type(source).__name__}"
        )
    source_dir = resolve_source_dir(source)
    read_source_config(source_dir)
    try:
        return Qwen3ForCausalLM.from_pretrained(source_dir, dtype=dtype or "auto").eval()
    except (RuntimeError, OSError) as err:
        raise ValueError(f"could not load the Qwen3 checkpoint {source_dir!r}: {err}") from err


def check_qwen3_model(source) -> None:
    src_type = getattr(source.config, "model_type", None)
    if src_type != "qwen3" or not hasattr(source, "lm_head"):
        raise ValueError(
            f"convert_qwen3 expects a Qwen3ForCausalLM; got {type(source).__name__} (model_type {src_type!r})"
        )


@contextlib.contextmanager
def quiet_loading():
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


def check_key_report(arch, new_prefixes: tuple[str, ...], missing, unexpected, mismatched=None) -> None:
    """A key-preserving load may only miss the architecture's new modules (`new_prefixes`)."""
    bad_missing = [k for k in missing if not k.startswith(new_prefixes)]
    if unexpected or bad_missing or mismatched:
        raise ValueError(
            f"source checkpoint does not match a Qwen3 backbone for arch {arch!r}: "
            f"unexpected keys {list(unexpected)[:5]}, missing keys {bad_missing[:5]}, "
            f"mismatched shapes {list(mismatched or [])[:5]}"
        )
