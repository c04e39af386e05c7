"""Lookahead depth supervision labels for TaH2 (the paper's Eqs. 5, 6, 24–26: oracle depths from the lookahead losses, their continue labels and weights).

At each boundary m = 1..M−1 every supervised token that executed depth m has a gain
    δ(m) = ℓ(m) − ℓ(m+1)                    (per-iteration losses; ℓ(m+1) from the lookahead pass)
The positive gains of the candidates (executed m, still labelled "continue" at m−1) are pooled over all data-parallel
ranks; the coverage cutoff δ_cut is the smallest gain among the largest ones that cover a fraction ρ of the total
positive gain. Continue labels c(m) = a(m)·c(m−1)·[δ ≥ δ_cut] (ties continue; once 0, always 0). Weights
w = clip(|δ − δ_cut|, cost_min, cost_max) for tokens still labelled continue at m−1, cost_min otherwise. The class
balance β = #stop / #continue (pooled over ranks; 1 if a class is absent; clamped) is the BCE's positive weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_variable(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor of per-rank variable length over all ranks (pad to the longest, then trim)."""
    if not _distributed():
        return values
    count = torch.tensor([values.numel()], device=values.device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    width = int(max(int(c) for c in counts))
    padded = torch.zeros(width, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c)] for g, c in zip(gathered, counts, strict=True)])


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if _distributed():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def coverage_cutoff(positive_gains: torch.Tensor, rho: float) -> float | None:
    """δ_cut = δ_[i_cov], i_cov = min{i : Σ_{i'≤i} δ_[i'] ≥ ρ Σ δ} over gains sorted descending; None if empty."""
    if positive_gains.numel() == 0:
        return None
    gains = positive_gains.double().sort(descending=True).values
    cumulative = gains.cumsum(0)
    target = rho * cumulative[-1]
    i_cov = int(torch.searchsorted(cumulative, target.unsqueeze(0), right=False))
    return float(gains[min(i_cov, gains.numel() - 1)])


@dataclass
class DepthLabels:
    """Per boundary m (list index m−1): labels, weights, the tokens that get a BCE term, δ_cut, β."""

    continue_labels: list = field(default_factory=list)  # (B, T) bool
    weights: list = field(default_factory=list)  # (B, T) fp32
    bce_mask: list = field(default_factory=list)  # (B, T) bool: supervised ∧ executed depth m
    gains: list = field(default_factory=list)  # (B, T) fp32 δ (0 where not executed)
    delta_cut: list = field(default_factory=list)  # float per boundary
    beta: list = field(default_factory=list)  # float per boundary
    iter_count_labels: torch.Tensor | None = None  # (B, T) min(M, 1 + Σ_m c(m))


def compute_depth_labels(
    executed: list,
    token_loss: list,
    lookahead_loss: list,
    supervised: torch.Tensor,
    max_iterations: int,
    coverage: float = 0.99,
    cost_min: float = 1e-6,
    cost_max: float = 1.0,
    beta_clamp: tuple[float, float] | None = (0.02, 50.0),
) -> DepthLabels:
    """Labels for boundaries m = 1..M−1.

    Args:
        executed: per depth m (index m−1), a(m) as (B, T) bool; missing depths count as not executed.
        token_loss: per depth, ℓ(m) (B, T) from the main forward.
        lookahead_loss: per boundary m, ℓ(m+1) (B, T) from the lookahead pass (defined where a(m) = 1).
        supervised: (B, T) bool, tokens with a target.
    Every rank must call this with the same `max_iterations` (collectives run once per boundary).
    """
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    if not 0.0 < cost_min <= cost_max:
        raise ValueError(f"cost_min/cost_max must satisfy 0 < cost_min <= cost_max, got {cost_min}, {cost_max}")
    out = DepthLabels()
    zeros_bool = torch.zeros_like(supervised)
    prev_c = torch.ones_like(supervised)  # c(0) = 1
    label_sum = torch.zeros(supervised.shape, dtype=torch.long, device=supervised.device)
    for m in range(1, max_iterations):
        a = executed[m - 1] if m - 1 < len(executed) else zeros_bool
        if m - 1 < len(lookahead_loss) and m - 1 < len(token_loss):
            delta = torch.where(a, token_loss[m - 1] - lookahead_loss[m - 1], torch.zeros((), device=a.device))
        else:
            delta = torch.zeros(supervised.shape, device=supervised.device)
        delta = delta.float()
        candidates = supervised & a & prev_c
        positive = delta[candidates & (delta > 0)].double()
        cut = coverage_cutoff(gather_variable(positive), coverage)
        if cut is None:  # no positive gain anywhere: no continue label from here on; δ_cut = 0 for the weights
            cut = 0.0
            c = zeros_bool
        else:
            c = candidates & (delta.double() >= cut)
        terms = supervised & a
        w = torch.where(prev_c, (delta - cut).abs().clamp(cost_min, cost_max), torch.full_like(delta, cost_min))
        w = torch.where(terms, w, torch.zeros_like(w))
        counts = sum_over_ranks(torch.stack([(terms & ~c).sum(), (terms & c).sum()]).double())
        n_stop, n_cont = float(counts[0]), float(counts[1])
        beta = n_stop / n_cont if n_stop > 0 and n_cont > 0 else 1.0
        if beta_clamp is not None:
            beta = min(max(beta, beta_clamp[0]), beta_clamp[1])
        out.continue_labels.append(c)
        out.weights.append(w)
        out.bce_mask.append(terms)
        out.gains.append(delta)
        out.delta_cut.append(cut)
        out.beta.append(beta)
        label_sum = label_sum + c.long()
        prev_c = c
    out.iter_count_labels = (1 + label_sum).clamp(max=max_iterations)
    return out


def decider_bce_sum(decider_logits: list, labels: DepthLabels, margin: float = 0.0) -> torch.Tensor:
    """Σ_m Σ_t w(m) · BCE(g(m), c(m)) with positive weight β(m), fp32 (Eq. 26); `margin` shifts the logit ∓."""
    total = None
    # The labels cover every depth 1..M-1; the model returns decider logits only for the depths some token reached
    # (its per-depth buffers grow with the depth reached), so the zip stops at the deepest decision taken.
    for _m, (logit, c, w, terms, beta) in enumerate(
        zip(decider_logits, labels.continue_labels, labels.weights, labels.bce_mask, labels.beta, strict=False)
    ):
        target = c.float()
        shifted = logit.float() - margin * (2 * target - 1)
        pos_weight = torch.tensor(beta, dtype=torch.float32, device=logit.device)
        bce = F.binary_cross_entropy_with_logits(shifted, target, pos_weight=pos_weight, reduction="none")
        term = (bce * w * terms.float()).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


def ouro_gate_targets(loss_now: torch.Tensor, loss_next: torch.Tensor, sharpness: float = 50.0,
                      margin: float = 0.005) -> torch.Tensor:
    """Ouro Stage II soft continue targets: c̃ = σ(k(I − γ)), I = max(0, sg[ℓ(m) − ℓ(m+1)])."""
    improvement = (loss_now.detach().float() - loss_next.detach().float()).clamp(min=0.0)
    return torch.sigmoid(sharpness * (improvement - margin))


def ouro_gate_loss_sum(records, sharpness: float = 50.0, margin: float = 0.005) -> torch.Tensor:
    """Σ_{m<M} Σ_t BCE(1 − λ(m), c̃(m)) over supervised tokens, divided by M (Eq. 11 before the 1/N).

    `records` are the main forward's loop records: every token runs every depth under the exit gate, so ℓ(m) and
    ℓ(m+1) exist for all of them; the continue logit is logit(1 − λ)."""
    supervised = records.targets != -100
    M = records.max_iterations
    total = torch.zeros((), device=records.targets.device)
    for m in range(1, min(M, len(records.token_logprob))):
        both = supervised & records.executed[m - 1] & records.executed[m]
        target = ouro_gate_targets(-records.token_logprob[m - 1], -records.token_logprob[m], sharpness, margin)
        bce = F.binary_cross_entropy_with_logits(records.decider_logits[m - 1].float(), target, reduction="none")
        total = total + (bce * both.float()).sum()
    return total / M
