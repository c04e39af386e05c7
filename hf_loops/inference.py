"""Token-by-token decoding that reports each token's executed depth (for demos, depth maps and the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core.compat import cache_kwargs, cache_of
from .modeling import loop_utils


@dataclass
class DepthTrace:
    tokens: list[int]  # generated token ids
    # Depth that produced each generated token's distribution (the previous position's m_t); None when the model does
    # not report per-token depth (SpiralFormer, SGT, plain Qwen3: their depth is the same for every token).
    depths: list[int] | None
    prompt_depths: list[int] | None  # executed depth of every prompt token (prefill cascade), or None


def check_model_loop_knobs(model, loop_kwargs: dict) -> None:
    """Per-call loop knobs: explicit values (0 included) are validated, never dropped. A knob the model's forward
    does not take → `ValueError` naming it and the model type."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    model_type = getattr(model.config, "model_type", type(model).__name__)
    for name, _value in loop_kwargs.items():
        if name not in accepted:
            raise ValueError(f"{name} is a knob of adaptive-depth models (TaH2); a {model_type!r} model has no {name}")
    loop_utils.check_loop_knobs(loop_kwargs.get("max_iterations"), loop_kwargs.get("exit_threshold"))


def _depths(out) -> torch.Tensor | None:
    counts = getattr(out, "iter_counts", None)
    return counts if isinstance(counts, torch.Tensor) else None


@torch.no_grad()
def generate_with_depths(model, input_ids: torch.Tensor, max_new_tokens: int = 20, eos_token_id: int | None = None,
                         do_sample: bool = False, temperature: float = 1.0, **loop_kwargs) -> DepthTrace:
    """Greedy (or sampled) decoding of one prompt with the cache, recording per-token depths.

    Works for every causal LM whose forward returns `logits` and a `cache` (TaH2, SpiralFormer, SGT, Qwen3). The
    distribution of generated token t comes from position t−1, so its depth is that position's m_t; models that do not
    report depth (`iter_counts`) give `depths=None`. `loop_kwargs` (max_iterations, exit_threshold) are validated and
    passed to every forward call; a knob the model does not take is a `ValueError`.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("generate_with_depths takes one prompt: input_ids of shape (1, T)")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty (0 tokens): give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_model_loop_knobs(model, loop_kwargs)
    model.eval()
    out = model(input_ids, use_cache=True, logits_to_keep=1, **loop_kwargs)
    counts = _depths(out)
    prompt_depths = counts[0].tolist() if counts is not None else None
    tokens, depths = [], ([] if counts is not None else None)
    cache, logits = cache_of(out), out.logits[:, -1]
    last_depth = prompt_depths[-1] if prompt_depths is not None else None
    for _ in range(max_new_tokens):
        if do_sample:
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        if depths is not None:
            depths.append(int(last_depth))
        if eos_token_id is not None and int(nxt) == eos_token_id:
            break
        out = model(nxt, use_cache=True, **cache_kwargs(cache), **loop_kwargs)
        cache, logits = cache_of(out), out.logits[:, -1]
        counts = _depths(out)
        if depths is not None and counts is not None:
            last_depth = int(counts[0, -1])
    return DepthTrace(tokens=tokens, depths=depths, prompt_depths=prompt_depths)
