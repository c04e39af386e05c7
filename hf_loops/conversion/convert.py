"""Qwen3 → looped-model retrofits: a key-preserving load of the Qwen3 weights plus freshly initialised new modules."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel

from ..modeling.loop_utils import check_known_keys
from .hub import resolve_source_dir
from .qwen3_source import (
    cast_model,
    check_key_report,
    check_qwen3_model,
    load_qwen3_source,
    load_source_tokenizer,
    quiet_loading,
    qwen3_config_fields,
    read_source_config,
    resolve_tokenizer,
)
from .registry import ARCHITECTURES, get_spec

__all__ = ["convert_qwen3", "load_qwen3_source", "load_source_tokenizer", "qwen3_config_fields", "cast_model"]

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
    spec = get_spec(arch)
    # A misspelt field would otherwise be written verbatim into config.json and silently ignored.
    check_known_keys(spec.config_class, config_overrides, what="field")
    options = (("layer_map", layer_map is not None), ("core_init", core_init != "select"),
               ("calibration", calibration is not None))
    for option, used in options:
        if used and option not in spec.convert_options:
            owners = [s.name for s in ARCHITECTURES.values() if option in s.convert_options]
            raise ValueError(f"{option} applies to arch {' / '.join(repr(o) for o in owners)} only, not {arch!r}")
    source_dir = resolve_source_dir(source) if isinstance(source, (str, os.PathLike)) else None
    if source_dir is not None and spec.import_native is not None:
        model = spec.import_native(source_dir, allow_pickle=allow_pickle, **config_overrides)
        if model is not None:
            return cast_model(model, dtype) if dtype is not None else model

    if spec.build is not None:
        qwen = load_qwen3_source(source_dir if source_dir is not None else source, dtype=dtype)
        model = spec.build(qwen, layer_map=layer_map, core_init=core_init, **config_overrides)
    else:
        model = _key_preserving_load(spec, source, source_dir, dtype, config_overrides)
    if dtype is not None:
        model = cast_model(model, dtype)
    if spec.finish is not None:
        spec.finish(model, calibration=calibration,
                    tokenizer=resolve_tokenizer(tokenizer, source_dir) if calibration is not None else None)
    return model.eval()


def _key_preserving_load(spec, source, source_dir, dtype, config_overrides) -> PreTrainedModel:
    """The Qwen3 weights under their own names plus freshly initialised new modules (TaH2, SGT)."""
    config_cls, model_cls = spec.config_class, spec.model_class
    if isinstance(source, PreTrainedModel):
        check_qwen3_model(source)
        config = config_cls(**{**qwen3_config_fields(source.config), **config_overrides})
        model = cast_model(model_cls(config), next(source.parameters()).dtype)
        missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        check_key_report(spec.name, spec.new_module_prefixes, missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
        return model
    if source_dir is None:
        raise ValueError(
            f"convert_qwen3 source must be a Qwen3ForCausalLM, a local directory or a Hub id, got {type(source).__name__}"
        )
    config = config_cls(**{**qwen3_config_fields(read_source_config(source_dir)), **config_overrides})
    try:
        with quiet_loading():  # the new modules are expected to be missing; the key report is checked below
            model, info = model_cls.from_pretrained(source_dir, config=config, output_loading_info=True,
                                                    dtype=dtype or "auto")
    except (RuntimeError, OSError) as err:  # shape mismatches (RuntimeError), missing weight files (OSError)
        raise ValueError(f"source checkpoint {source_dir!r} does not match its config.json: {err}") from err
    check_key_report(spec.name, spec.new_module_prefixes, info["missing_keys"], info["unexpected_keys"], info.get("mismatched_keys"))
    return model
