"""Token-by-token decoding that reports each token's executed depth (for demos, depth maps and the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DepthTrace:
    tokens: list[int]  # generated token ids
    depths: list[int]  # depth that produced each generated token's distribution (the previous position's m_t)
    prompt_depths: list[int]  # executed depth of every prompt token (prefill cascade)


@torch.no_grad()
def generate_with_depths(model, input_ids: torch.Tensor, max_new_tokens: int = 20, eos_token_id: int | None = None,
                         do_sample: bool = False, temperature: float = 1.0, **loop_kwargs) -> DepthTrace:
    """Greedy (or sampled) decoding of one prompt with the cache, recording per-token depths.

    The distribution of generated token t comes from position t−1, so its depth is that position's m_t.
    `loop_kwargs` (max_iterations, exit_threshold) are passed to every forward call.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("generate_with_depths takes one prompt: input_ids of shape (1, T)")
    model.eval()
    out = model(input_ids, use_cache=True, logits_to_keep=1, **loop_kwargs)
    prompt_depths = out.iter_counts[0].tolist()
    tokens, depths = [], []
    cache, logits, last_depth = out.cache, out.logits[:, -1], prompt_depths[-1]
    for _ in range(max_new_tokens):
        if do_sample:
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        depths.append(int(last_depth))
        if eos_token_id is not None and int(nxt) == eos_token_id:
            break
        out = model(nxt, cache=cache, use_cache=True, **loop_kwargs)
        cache, logits, last_depth = out.cache, out.logits[:, -1], int(out.iter_counts[0, -1])
    return DepthTrace(tokens=tokens, depths=depths, prompt_depths=prompt_depths)
