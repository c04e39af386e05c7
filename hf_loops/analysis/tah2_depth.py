"""TaH2 depth tools (docs/analysis.md): decider–gain alignment and loss change under forced depth.
(The per-token depth map lives in `depth_map.py`.)"""

from __future__ import annotations

import contextlib

import torch

SMALL_CHANGE = 1e-3


def decider_gain_alignment(g1, loss1, loss2, mask=None, bins: int = 20) -> list[dict]:
    """bin tokens by the continue probability g⁽¹⁾ (equal-width bins on [0, 1]); per bin the mean loss reduction
    of a second iteration δ = ℓ⁽¹⁾ − ℓ⁽²⁾ and the token count. Empty bins report mean_gain None."""
    g1, loss1, loss2 = (torch.as_tensor(x).float().flatten() for x in (g1, loss1, loss2))
    keep = torch.ones_like(g1, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool().flatten()
    keep &= ~torch.isnan(g1)
    g, delta = g1[keep], (loss1 - loss2)[keep]
    idx = (g * bins).long().clamp(0, bins - 1)
    rows = []
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        rows.append({"bin": b, "g_lo": b / bins, "g_hi": (b + 1) / bins, "count": n,
                     "mean_gain": float(delta[sel].mean()) if n else None})
    return rows


def loss_change_fractions(delta, eps: float = SMALL_CHANGE) -> dict:
    """Δ = ℓ⁽¹⁾ − ℓ⁽ᴹ⁾: fractions worse (Δ < −eps), little change (|Δ| ≤ eps), improved (Δ > eps)."""
    d = torch.as_tensor(delta).float().flatten()
    n = max(d.numel(), 1)
    return {"worse": float((d < -eps).sum()) / n, "little": float((d.abs() <= eps).sum()) / n,
            "improved": float((d > eps).sum()) / n, "n": d.numel()}


@contextlib.contextmanager
def forced_depth(model):
    """Every token continues (decider `always`) for the duration; the instance attribute is removed afterwards."""
    def always(embeds, hidden, logits):
        return torch.full((embeds.shape[0],), float("inf"), device=embeds.device)

    model._continue_logit = always
    try:
        yield model
    finally:
        del model._continue_logit


def _targets_mask(records, attention_mask):
    mask = records.targets != -100
    if attention_mask is not None:
        mask &= attention_mask.bool()
    return mask


@torch.no_grad()
def decider_gain_records(model, input_ids, attention_mask=None) -> dict:
    """Teacher-forced g⁽¹⁾, ℓ⁽¹⁾ and ℓ⁽²⁾ per token (ℓ⁽²⁾ from the main pass when the token continued, from the
    lookahead pass when it stopped). Needs max_iterations ≥ 2 and a learned decider."""
    if model.config.max_iterations < 2:
        raise ValueError("decider–gain alignment needs a TaH2 model with max_iterations >= 2")
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False,
                return_loop_records=True)
    rec = out.loop_records
    g1 = torch.sigmoid(rec.decider_logits[0].float())
    loss1 = -rec.token_logprob[0]
    look = model.lookahead_logprobs(rec)
    main2 = rec.token_logprob[1] if len(rec.token_logprob) > 1 else torch.zeros_like(loss1)
    continued = rec.executed[1] if len(rec.executed) > 1 else torch.zeros_like(rec.executed[0])
    loss2 = -torch.where(continued, main2, look[0])
    return {"g1": g1, "loss1": loss1, "loss2": loss2, "mask": _targets_mask(rec, attention_mask) & rec.executed[0]}


@torch.no_grad()
def forced_depth_loss_change(model, input_ids, attention_mask=None, depth: int | None = None) -> torch.Tensor:
    """Δ_t = ℓ_t⁽¹⁾ − ℓ_t⁽ᴹ⁾ with every token forced to depth M (default the model's max_iterations), over the
    supervised tokens."""
    M = depth or model.config.max_iterations
    if M < 2:
        raise ValueError("forced-depth loss change needs depth >= 2")
    with forced_depth(model):
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False,
                    max_iterations=M, return_loop_records=True)
    rec = out.loop_records
    delta = rec.token_logprob[M - 1] - rec.token_logprob[0]  # ℓ1 − ℓM = log qM − log q1
    return delta[_targets_mask(rec, attention_mask)]


__all__ = ["decider_gain_alignment", "decider_gain_records", "forced_depth", "forced_depth_loss_change",
           "loss_change_fractions"]
