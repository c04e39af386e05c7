"""The authors' TaH2 checkpoint layout (docs/conversion.md): import into `TaH2ForCausalLM`, export back.

Layout: a plain Qwen3 checkpoint (`config.json` model_type "qwen3", `model.safetensors`, tokenizer files) plus
`tah_config.json` and the two components `iter_decider.bin` / `input_updater.bin`, each a `torch.save` dict
`{"class": name, "init_args": {...}, "state_dict": {...}}`. The layout (constants, reader and writer) lives in one
module, `modeling/tah2_official.py` (so `TaH2ForCausalLM.from_pretrained(dir)` works in remote code too); these are
thin wrappers that add Hub resolution and an atomic output directory.
"""

from __future__ import annotations

import os

import torch

from ..core.outdir import atomic_output_dir
from ..modeling.modeling_tah2 import TaH2ForCausalLM
from ..modeling.tah2_official import (
    TAH_CONFIG_FILE,
    check_official_equivalents,
    is_official_tah2_dir,
    load_official_tah2,
    write_official_tah2,
)
from .hub import resolve_source_dir

__all__ = ["export_tah2", "import_tah2", "is_official_tah2_dir", "load_official_tah2"]

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


def export_tah2(model: TaH2ForCausalLM, out_dir: str | os.PathLike, tokenizer=None) -> str:
    """Write `model` in the official layout; `import_tah2(out_dir)` gives back the same model (bit-identical).

    Written atomically (temporary sibling directory, moved into place at the end)."""
    check_official_equivalents(model.config, model)
    out_dir = os.fspath(out_dir)
    with atomic_output_dir(out_dir, "export_tah2") as tmp:
        write_official_tah2(model, tmp, tokenizer)
    return out_dir
