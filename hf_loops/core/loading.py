"""Loading a checkpoint for inference (eval, generate, analyze): every weight the model has must be in the files.

`from_pretrained` initialises a missing weight at random and only mentions it in its load report, so an `eval` of a
checkpoint without its decider weights would report the metrics of a random decider and exit 0. Here a missing key
is an error naming the keys."""

from __future__ import annotations

__all__ = ["check_tokenizer_fits", "load_causal_lm", "missing_weights_error"]


def missing_weights_error(path: str, missing) -> ValueError | None:
    """The error for a checkpoint whose files lack `missing` weights (None when nothing is missing)."""
    missing = sorted(set(missing or ()))
    if not missing:
        return None
    shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
    return ValueError(f"checkpoint {path!r} lacks weights of its model: {shown}; they would run randomly "
                      "initialised (re-export the checkpoint, or convert it again)")


def load_causal_lm(path: str, dtype=None, what: str = "checkpoint"):
    """`AutoModelForCausalLM.from_pretrained(path)` in eval mode, refusing a checkpoint that lacks weights; an
    unloadable one is a `ValueError` naming it."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_loops  # noqa: F401  (registers the architectures)

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                           output_loading_info=True)
    except (OSError, ValueError, KeyError, AssertionError, RuntimeError) as err:  # a size mismatch, a bad file
        detail = " ".join(str(err).split())[:300]
        raise ValueError(f"{what} {path!r} cannot be loaded: {detail}") from None
    err = missing_weights_error(path, info.get("missing_keys"))
    if err is not None:
        raise err
    return model.eval()


def check_tokenizer_fits(tokenizer, vocab_size: int, what: str = "tokenizer") -> None:
    """A tokenizer whose ids reach past the embedding rows would fail with an IndexError at the first rare token."""
    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(f"{what} has {n:,} tokens but the model's vocabulary has {vocab_size:,} rows: ids >= "
                         f"{vocab_size:,} have no embedding (use the model's own tokenizer)")
