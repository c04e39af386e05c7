"""Shared builders for the TaH2 tests: tiny random Qwen3 models and scripted deciders."""

import torch

from helpers.common import tiny_qwen3, tiny_qwen3_config  # noqa: F401  (re-exported for the tests)
from hf_loops.conversion import convert_qwen3


def tiny_tah2(seed=0, qwen_overrides=None, decisive=True, **tah2_overrides):
    """A converted tiny TaH2. `decisive` widens the decider's score weights so g stays far from τ (the fresh init
    gives g ≈ 0.5, where float noise could flip a decision between two equivalent computations)."""
    q = tiny_qwen3(seed, **(qwen_overrides or {}))
    model = convert_qwen3(q, "tah2", **tah2_overrides).eval()
    if decisive and model.decider is not None:
        with torch.no_grad():
            torch.manual_seed(seed + 1)
            model.decider.score.weight.normal_(0.0, 3.0)
    return model


def script_decider(model, fn):
    """Replace the decider by g = fn(embeds, hidden) so the continue pattern is known in advance."""

    def continue_logit(embeds, hidden, logits):
        return torch.logit(fn(embeds, hidden).float())

    model._continue_logit = continue_logit
    return model


def pattern_by_sign(embeds, hidden=None):
    """Continue iff the first embedding coordinate is positive (g = 0.9 / 0.1): the same answer at every depth."""
    return torch.where(embeds[..., 0] > 0, 0.9, 0.1)


def pattern_by_hidden(embeds, hidden):
    """Continue iff the first coordinate of h(m) is positive: a pattern that changes from depth to depth."""
    return torch.where(hidden[..., 0] > 0, 0.9, 0.1)


def min_margin(model, ids, **kw):
    """Smallest |g − τ| over every executed decision of a full forward."""
    with torch.no_grad():
        out = model(ids, use_cache=False, **kw)
    g = out.continue_probs
    g = g[~torch.isnan(g)]
    tau = kw.get("exit_threshold", model.config.exit_threshold)
    return float((g - tau).abs().min()) if g.numel() else 1.0


def left_padded_batch(lengths, seed, low=3, high=97):
    """Random ids (in [low, high)) for rows of the given lengths, left-padded with 0, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(low, high, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask
