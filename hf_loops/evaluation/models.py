"""The checkpoint side of `hf-loops eval`: a checkpoint path checked and loaded, its display name, and the per-call loop
knobs (`--max-iterations`, `--exit-threshold`) it takes."""

from __future__ import annotations

import json
import os
import sys

from .examples import looks_like_path


def check_checkpoint_path(path: str) -> None:
    """A checkpoint argument is a directory or a Hub id: a file, or a local-looking path that does not exist, is
    refused before anything is loaded."""
    if not os.path.isdir(path) and os.path.exists(path):
        raise ValueError(f"checkpoint {path!r} is a file; expected a model directory or a Hub id")
    if looks_like_path(path) and not os.path.exists(path):
        raise ValueError(f"checkpoint {path!r}: no such directory")


def load_model(path: str, dtype=None):
    """(model, tokenizer) from a local directory or Hub id; hf_loops' architectures are registered on import."""
    import torch
    from transformers import AutoTokenizer

    from ..core.loading import check_tokenizer_fits, load_causal_lm

    check_checkpoint_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load checkpoint {path!r}: {str(err).splitlines()[0]}") from None
    model = load_causal_lm(path, dtype or torch.float32)  # refuses a checkpoint that lacks weights, naming them
    check_tokenizer_fits(tokenizer, model.config.vocab_size, f"the tokenizer of {path!r}")
    return model, tokenizer


def run_name(model, path: str | None = None) -> str:
    """The model's display name in tables (the architecture registry's, e.g. "TaH2 (M=2)", "Standard (M=1)"). A Qwen3
    checkpoint that `hf-loops train --arch standard` wrote (its run record says so) is "Standard (M=1)", as the TaH2
    model it was trained as."""
    from ..conversion.registry import display_name

    if path and one_pass(model) and _trained_arch(path) == "standard":
        from types import SimpleNamespace

        from ..modeling.configuration_tah2 import TAH2_PRESETS

        return display_name(SimpleNamespace(model_type="tah2", **TAH2_PRESETS["standard"]))
    return display_name(model.config)


def _trained_arch(path: str) -> str | None:
    """The `--arch` of the `hf-loops train` run that wrote checkpoint directory `path` (its run_config.json), or None."""
    from ..training.train_tah2 import RUN_CONFIG_FILE

    try:
        with open(os.path.join(path, RUN_CONFIG_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    script = record.get("script") if isinstance(record, dict) else None
    return script.get("arch") if isinstance(script, dict) else None


def one_pass(model) -> bool:
    """A plain Qwen3 model: no loop, one pass (depth 1) for every token (it reports no `iter_counts`)."""
    return getattr(model.config, "model_type", None) == "qwen3"


def loop_kwargs(model, max_iterations, exit_threshold, only_supported: bool = False) -> dict:
    """The per-call loop knobs given (None: the checkpoint's own); a knob the model does not take is refused, not
    dropped (an SGT model evaluated "with --max-iterations 3" would otherwise report its own depth's numbers).
    `only_supported`: a baseline's knobs — those it does not take are left out, with a note."""
    import inspect

    from ..inference import check_model_loop_knobs

    kw = {k: v for k, v in (("max_iterations", max_iterations), ("exit_threshold", exit_threshold)) if v is not None}
    if only_supported:
        accepted = inspect.signature(model.forward).parameters
        dropped = sorted(k for k in kw if k not in accepted)
        if dropped:
            print(f"note: the {model.config.model_type!r} baseline has no {', '.join(dropped)}; evaluated as is",
                  file=sys.stderr)
        kw = {k: v for k, v in kw.items() if k in accepted}
    check_model_loop_knobs(model, kw)
    return kw



__all__ = ["check_checkpoint_path", "load_model", "loop_kwargs", "one_pass", "run_name"]
