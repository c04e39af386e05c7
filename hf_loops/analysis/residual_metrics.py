"""Residual-stream metrics (docs/analysis.md). Pure functions in fp32.

Tensor conventions: a residual X is (B, N, D) with a (B, N) validity mask; a trajectory over recurrences is
(R, B, N, D). Token reductions: mean over valid tokens of a sequence, then over sequences [D]. The `*_trace` helpers
read the same quantities off a `Trace`.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-12


def _valid(X: torch.Tensor, valid) -> torch.Tensor:
    return torch.ones(X.shape[-3], X.shape[-2], dtype=torch.bool, device=X.device) if valid is None else valid.bool()


def _token_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(..., B, N) → (...): mean over valid tokens, then over sequences that have one."""
    w = valid.float()
    per_seq = (values * w).sum(-1) / w.sum(-1).clamp_min(1)
    has = valid.any(-1)
    return per_seq[..., has].mean(-1)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-8)


def successive_difference(X_seq: torch.Tensor, valid=None, kind: str = "l2") -> torch.Tensor:
    """for t = 2..R: Δ = ‖X_t − X_{t−1}‖ ("l2"), Δ / ‖X_{t−1}‖ ("relative") or cos(X_t, X_{t−1}) ("cosine").
    X_seq (R, B, N, D) → (R − 1,)."""
    X = X_seq.float()
    valid = _valid(X, valid)
    a, b = X[1:], X[:-1]
    if kind == "l2":
        v = (a - b).norm(dim=-1)
    elif kind == "relative":
        v = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(EPS)
    elif kind == "cosine":
        v = _cos(a, b)
    else:
        raise ValueError(f"kind must be 'l2', 'relative' or 'cosine', got {kind!r}")
    return _token_mean(v, valid)


def fixed_point_distance(X_seq: torch.Tensor, valid=None, reference: torch.Tensor | None = None) -> dict:
    """mean_i ‖X_t,i − X*_i‖ and mean_i cos(X_t,i, X*_i) for t = 1..R; X* = the last recurrence by default."""
    X = X_seq.float()
    valid = _valid(X, valid)
    ref = X[-1] if reference is None else reference.float()
    return {"distance": _token_mean((X - ref).norm(dim=-1), valid), "cosine": _token_mean(_cos(X, ref), valid)}


def degenerate_fixed_point_score(fixed_points: torch.Tensor, valid=None) -> float:
    """min_{ℓ>1} mean_i cos(X*_1,i, X*_ℓ,i) for fixed points (L, B, N, D) of the L loop layers.
    → 1: one shared (degenerate) fixed point; well below 1: distinct per-layer (cyclic) fixed points. NaN if L < 2."""
    X = fixed_points.float()
    if X.shape[0] < 2:
        return float("nan")
    valid = _valid(X, valid)
    return float(_token_mean(_cos(X[1:], X[:1]), valid).min())


def residual_similarity_matrix(residuals: list, valid: list | None = None, per_token: bool = False) -> torch.Tensor:
    """cosine similarity between the residuals (B, N, D) after every realised step, (S, S); `valid` is one
    (B, N) mask per residual. Default: cosine of the mean-over-tokens residuals per sequence, averaged over
    sequences; `per_token`: per-token cosines, then the mean (needs equal shapes)."""
    n = len(residuals)
    masks = [_valid(X, None if valid is None else valid[i]) for i, X in enumerate(residuals)]
    out = torch.zeros(n, n)
    if per_token:
        for a in range(n):
            for b in range(n):
                Xa, Xb = residuals[a].float(), residuals[b].float()
                if Xa.shape != Xb.shape:
                    raise ValueError("per-token residual similarity needs residuals of equal shape")
                out[a, b] = _token_mean(_cos(Xa, Xb), masks[a] & masks[b])
        return out
    means = []
    for X, v in zip(residuals, masks, strict=True):
        w = v.float()[..., None]
        means.append((X.float() * w).sum(1) / w.sum(1).clamp_min(1))  # (B, D)
    for a in range(n):
        for b in range(n):
            out[a, b] = _cos(means[a], means[b]).mean()
    return out


def matrix_entropy(X: torch.Tensor, valid=None, normalized: bool = False) -> torch.Tensor:
    """spectral entropy of each sequence's (T, D) residual (uncentred): p_j = σ_j² / ‖X‖_F²,
    H = −Σ p_j log p_j (optionally / log min(T, D)); mean over sequences."""
    X = X.float()
    if X.dim() == 2:
        X = X[None]
    valid = _valid(X, valid)
    values = []
    for b in range(X.shape[0]):
        x = X[b][valid[b]]
        if x.shape[0] == 0:
            continue
        s2 = torch.linalg.svdvals(x) ** 2
        p = s2 / s2.sum().clamp_min(EPS)
        h = -(p * torch.log(p.clamp_min(EPS))).sum()
        if normalized:
            m = min(x.shape)
            h = h / math.log(m) if m > 1 else torch.zeros(())
        values.append(h)
    return torch.stack(values).mean() if values else torch.zeros(())


def residual_norm(X: torch.Tensor, valid=None) -> dict:
    """mean ‖x_i‖ over valid tokens and the norm of the first valid token (BOS when the tokenizer adds one)."""
    X = X.float()
    valid = _valid(X, valid)
    norms = X.norm(dim=-1)
    first = valid.float().argmax(-1)
    has = valid.any(-1)
    bos = norms[torch.arange(X.shape[0]), first][has].mean()
    return {"mean": _token_mean(norms, valid), "first": bos}


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    def ranks(v):
        order = v.argsort()
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=v.dtype)
        for value in v.unique():  # average ranks for ties
            tie = v == value
            if tie.sum() > 1:
                r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x.double()), ranks(y.double())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = (rx.norm() * ry.norm()).item()
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def classify_trajectory(s: torch.Tensor, tau: float = 0.05, rho: float = 0.9) -> tuple[str, float | None]:
    """one token's series s_t = cos(x_t, x_{T_fp}), t = 1..T_fp → (label, dominant period or None).

    fixed point: 1 − s_t < τ for ≥ ρ of the last half; orbit: not fixed, amplitude (max − min over the last half) > τ
    and Δs_t changes sign ≥ 2 times [D: amplitude read over the last half]; slider: Spearman(t, s_t) > 0.9 over the
    last half; unknown otherwise."""
    s = torch.as_tensor(s).double().flatten()
    half = s[len(s) // 2:]
    if len(half) == 0:
        return "unknown", None
    if float(((1 - half) < tau).double().mean()) >= rho:
        return "fixed_point", None
    d = half[1:] - half[:-1]
    signs = torch.sign(d[d.abs() > 1e-9])
    changes = int((signs[1:] != signs[:-1]).sum()) if len(signs) > 1 else 0
    if changes >= 2 and float(half.max() - half.min()) > tau:
        x = half - half.mean()
        spec = torch.fft.rfft(x).abs()
        spec[0] = 0
        k = int(spec.argmax())
        return "orbit", (len(half) / k if k > 0 else None)
    if len(half) > 2 and _spearman(torch.arange(len(half), dtype=torch.double), half) > 0.9:
        return "slider", None
    return "unknown", None


def classify_limiting_behaviour(X_seq: torch.Tensor, valid=None, tau: float = 0.05, rho: float = 0.9) -> dict:
    """per token of the last loop layer's trajectory (R, B, N, D), reference = the last recurrence.
    Returns counts, fractions, per-token labels (B, N lists, None for invalid tokens) and orbit periods."""
    X = X_seq.float()
    valid = _valid(X, valid)
    s = _cos(X, X[-1])  # (R, B, N)
    labels = [[None] * X.shape[2] for _ in range(X.shape[1])]
    counts = {"fixed_point": 0, "orbit": 0, "slider": 0, "unknown": 0}
    periods = []
    for b, i in valid.nonzero().tolist():
        label, period = classify_trajectory(s[:, b, i], tau, rho)
        labels[b][i] = label
        counts[label] += 1
        if period is not None:
            periods.append(period)
    total = max(sum(counts.values()), 1)
    return {"counts": counts, "fractions": {k: v / total for k, v in counts.items()}, "labels": labels,
            "orbit_periods": periods}


# --- the same quantities read off a Trace --------------------------------------------------------------------------------


def successive_difference_trace(trace, kind: str = "l2") -> dict[int, torch.Tensor]:
    """Loop layer ℓ → (R − 1,) successive differences."""
    out = {}
    for ell in trace.loop_layers:
        X, v = trace.loop_residuals(ell)
        if X.shape[0] > 1:
            out[ell] = successive_difference(X, v, kind)
    return out


def fixed_point_distance_trace(trace) -> dict[int, dict]:
    """Loop layer ℓ → distance/cosine to X*_ℓ = X_{ℓ,R} (run the trace with R = T_fp recurrences, e.g. 128)."""
    return {ell: fixed_point_distance(*trace.loop_residuals(ell)) for ell in trace.loop_layers}


def degenerate_fixed_point_score_trace(trace) -> float:
    layers = trace.loop_layers
    stars, valid = [], None
    for ell in layers:
        X, v = trace.loop_residuals(ell)
        stars.append(X[-1])
        valid = v if valid is None else valid & v
    if len(stars) < 2 or len({tuple(x.shape) for x in stars}) > 1:
        return float("nan")
    return degenerate_fixed_point_score(torch.stack(stars), valid)


def fixed_point_separation_trace(trace) -> float:
    """max over loop layers ℓ > 1 of the mean relative distance ‖X*_1 − X*_ℓ‖ / ‖X*_1‖ between per-layer fixed points
    (X*_ℓ = the last recurrence); NaN with one loop layer."""
    stars, valid = [], None
    for ell in trace.loop_layers:
        X, v = trace.loop_residuals(ell)
        stars.append(X[-1].float())
        valid = v if valid is None else valid & v
    if len(stars) < 2:
        return float("nan")
    w = valid.float()
    rel = [((x - stars[0]).norm(dim=-1) / stars[0].norm(dim=-1).clamp_min(EPS) * w).sum() / w.sum().clamp_min(1)
           for x in stars[1:]]
    return float(torch.stack(rel).max())


def classify_limiting_behaviour_trace(trace, tau: float = 0.05, rho: float = 0.9) -> dict:
    X, v = trace.loop_residuals(trace.loop_layers[-1])
    return classify_limiting_behaviour(X, v, tau, rho)


def residual_norm_trace(trace) -> list[dict]:
    return [residual_norm(s.residual, s.valid) for s in trace.steps if s.residual is not None]


__all__ = ["classify_limiting_behaviour", "classify_limiting_behaviour_trace", "classify_trajectory",
           "degenerate_fixed_point_score", "degenerate_fixed_point_score_trace", "fixed_point_distance",
           "fixed_point_distance_trace", "fixed_point_separation_trace", "matrix_entropy", "residual_norm", "residual_norm_trace",
           "residual_similarity_matrix", "successive_difference", "successive_difference_trace"]
