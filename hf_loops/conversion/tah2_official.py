"""The authors' TaH2 checkpoint layout (spec: shared/specs/tah2.md §8): import into `TaH2ForCausalLM`, export back.

Layout: a plain Qwen3 checkpoint (`config.json` model_type "qwen3", `model.safetensors`, tokenizer files) plus
`tah_config.json` and the two components `iter_decider.bin` / `input_updater.bin`, each a `torch.save` dict
`{"class": name, "init_args": {...}, "state_dict": {...}}`. Loading lives in `modeling/tah2_official.py` (so
`TaH2ForCausalLM.from_pretrained(dir)` works too); this module adds Hub resolution and the writer.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..modeling.modeling_tah2 import TaH2ForCausalLM
from ..modeling.tah2_official import (
    DECIDER_CLASSES,
    DECIDER_FILE,
    MIXTURES,
    TAH_CONFIG_FILE,
    UPDATER_CLASSES,
    UPDATER_FILE,
    is_official_tah2_dir,
    load_official_tah2,
)
from .export import atomic_output_dir
from .hub import resolve_source_dir
from .qwen3_source import qwen3_config_fields

__all__ = ["export_tah2", "import_tah2", "is_official_tah2_dir", "load_official_tah2"]

_DECIDER_NAMES = {v: k for k, v in DECIDER_CLASSES.items()}
_UPDATER_NAMES = {v: k for k, v in UPDATER_CLASSES.items()}
_MIXTURE_NAMES = {v: k for k, v in MIXTURES.items()}


def import_tah2(path_or_repo, allow_pickle: bool = False, dtype: torch.dtype | None = None, **overrides):
    """Load an official TaH2 checkpoint (local directory or Hub id) as a `TaH2ForCausalLM`.

    `overrides` are TaH2Config fields that replace the checkpoint's (e.g. `max_iterations=4`, `exit_threshold=0.6`).
    """
    path = resolve_source_dir(path_or_repo)
    if not is_official_tah2_dir(path):
        raise ValueError(f"{path_or_repo!r} is not an official TaH2 checkpoint: {TAH_CONFIG_FILE} is missing")
    kwargs = dict(overrides)
    if dtype is not None:
        kwargs["dtype"] = dtype
    return TaH2ForCausalLM.from_pretrained(path, allow_pickle=allow_pickle, **kwargs)


def _tah2_only_fields(config) -> set[str]:
    return set(type(config).__annotations__)


def export_tah2(model: TaH2ForCausalLM, out_dir: str | os.PathLike, tokenizer=None) -> str:
    """Write `model` in the official layout; `import_tah2(out_dir)` gives back the same model (bit-identical).

    Written atomically (temporary sibling directory, moved into place at the end).
    """
    cfg = model.config
    if cfg.updater not in _UPDATER_NAMES:
        raise ValueError(f"export_tah2: updater {cfg.updater!r} has no official equivalent "
                         f"(official: {sorted(_UPDATER_NAMES)})")
    if cfg.decider not in _DECIDER_NAMES:
        raise ValueError(f"export_tah2: decider {cfg.decider!r} has no official equivalent "
                         f"(official: {sorted(_DECIDER_NAMES)})")
    if cfg.mixture not in _MIXTURE_NAMES:
        raise ValueError(f"export_tah2: mixture {cfg.mixture!r} has no official equivalent "
                         f"(official: {sorted(_MIXTURE_NAMES)})")
    out_dir = os.fspath(out_dir)
    with atomic_output_dir(out_dir, "export_tah2") as tmp:
        # 1) the plain Qwen3 backbone: the same tensors under a Qwen3ForCausalLM (built on meta, no copy)
        fields = {k: v for k, v in qwen3_config_fields(cfg).items() if k not in _tah2_only_fields(cfg)}
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
        decider_cls, updater_cls = _DECIDER_NAMES[cfg.decider], _UPDATER_NAMES[cfg.updater]
        tah = {
            "embedding_key": "model.embed_tokens",
            "max_iter": cfg.max_iterations,
            "iter_attention_mode": cfg.iteration_attention,
            "weighted_hidden_method": _MIXTURE_NAMES[cfg.mixture],
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
    return out_dir
