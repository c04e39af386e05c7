"""Attention metrics (docs/analysis.md). Pure functions on float tensors, computed in fp32.

Every function takes attention weights `A` of shape (B, H, Tq, Tk) — (H, Tq, Tk) and (Tq, Tk) are accepted too — and
the optional validity masks of `AttentionRecord.masks()`:
    row_mask (B, Tq) valid query rows, key_mask (B, Tk) valid keys, visible (B, Tq, Tk) keys each row may see
    (default: causal j ≤ i aligned at the end, within the valid keys), query_pos / key_pos (B, Tq) / (B, Tk) indices
    in the loop's own coordinates (default: 0..T−1).
Per-head results are averaged over sequences (each sequence with its own valid T) and returned as (H,) tensors.
log is natural; probabilities are clamped at 1e−12 before the log, so 0·log 0 = 0.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-12


def _xlogx(p: torch.Tensor) -> torch.Tensor:
    return p * torch.log(p.clamp_min(EPS))


def _prepare(A, row_mask=None, key_mask=None, visible=None, query_pos=None, key_pos=None):
    """A → (B, H, Tq, Tk) fp32 and the full set of masks (B, Tq), (B, Tk), (B, Tq, Tk), positions."""
    A = torch.as_tensor(A).float()
    if A.dim() == 2:
        A = A[None, None]
    elif A.dim() == 3:
        A = A[None]
    if A.dim() != 4:
        raise ValueError(f"attention must have shape (B, H, Tq, Tk), got {tuple(A.shape)}")
    B, _, Tq, Tk = A.shape
    dev = A.device
    rows = torch.ones(B, Tq, dtype=torch.bool, device=dev) if row_mask is None else row_mask.to(dev).bool()
    keys = torch.ones(B, Tk, dtype=torch.bool, device=dev) if key_mask is None else key_mask.to(dev).bool()
    if visible is None:
        i = torch.arange(Tq, device=dev)[:, None] + (Tk - Tq)
        visible = (torch.arange(Tk, device=dev)[None, :] <= i)[None].expand(B, Tq, Tk)
    vis = visible.to(dev).bool() & keys[:, None, :] & rows[:, :, None]
    qp = torch.arange(Tq, device=dev).expand(B, Tq) if query_pos is None else query_pos.to(dev)
    kp = torch.arange(Tk, device=dev).expand(B, Tk) if key_pos is None else key_pos.to(dev)
    A = torch.where(vis[:, None], A, torch.zeros((), device=dev))
    return A, rows, keys, vis, qp, kp


def _mean_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq) per-row values → (H,): mean over the selected rows of each sequence, then over sequences."""
    w = rows.float()[:, None, :]
    per_seq = (values * w).sum(-1) / w.sum(-1).clamp_min(1)  # (B, H)
    has = rows.any(-1)
    return per_seq[has].mean(0) if has.any() else torch.zeros(values.shape[1], device=values.device)


def row_entropy(A, normalized: bool = False, **masks) -> torch.Tensor:
    """(B, H, Tq) H_i = −Σ_j A_ij log A_ij; `normalized`: H_i / log n_i (n_i visible keys; 0 when n_i ≤ 1)."""
    A, rows, keys, vis, _, _ = _prepare(A, **masks)
    h = -_xlogx(A).sum(-1)
    if normalized:
        n = vis.sum(-1).float()[:, None]
        h = torch.where(n > 1, h / torch.log(n.clamp_min(2)), torch.zeros((), device=h.device))
    return h


def _selected_rows(rows_mode, rows: torch.Tensor) -> torch.Tensor:
    """The query set Q as a (B, Tq) mask: all valid rows, the last valid row, or `m` rows (SGT's selection statistic: the last
    row plus m−1 rows spread evenly over the valid positions ≥ 64)."""
    if rows_mode == "all":
        return rows
    B, T = rows.shape
    idx = torch.arange(T, device=rows.device)
    last = torch.where(rows, idx, torch.full_like(idx, -1)).amax(-1)
    out = torch.zeros_like(rows)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = True
    if rows_mode == "last":
        return out
    if isinstance(rows_mode, bool) or not isinstance(rows_mode, int) or rows_mode < 1:
        raise ValueError(f"rows must be 'all', 'last' or a positive integer, got {rows_mode!r}")
    from ..modeling.modeling_sgt import probe_rows_from_mask

    picks = probe_rows_from_mask(rows.long(), B, T, "sampled_rows", rows_mode, rows.device)
    out = torch.zeros_like(rows).scatter(1, picks, True)
    return out & rows


def attention_entropy(A, rows="all", normalized: bool = False, **masks) -> torch.Tensor:
    """head entropy (H,): mean row entropy over the query set, then over sequences. `rows="last"` is the SGT
    statistic (the last valid row, normalised by log T when `normalized`); `rows=m` reads m rows (SGT's statistic on m rows)."""
    h = row_entropy(A, normalized=normalized, **masks)
    _, rows_mask, _, _, _, _ = _prepare(A, **masks)
    return _mean_rows(h, _selected_rows(rows, rows_mask))


def mixing_score(A, normalized: bool = False, **masks) -> torch.Tensor:
    """(1/T) Σ_i H(A_i,:) per head (raw row entropies; `normalized` uses H̃_i)."""
    return attention_entropy(A, rows="all", normalized=normalized, **masks)


def key_marginal(A, query_mask=None, **masks) -> tuple[torch.Tensor, torch.Tensor]:
    """p(j) = (1/|Q|) Σ_{i∈Q} A_ij, (B, H, Tk), and the (B,) sequences that have a query."""
    A, rows, keys, _, _, _ = _prepare(A, **masks)
    q = rows if query_mask is None else rows & query_mask.to(rows.device).bool()
    n = q.sum(-1).float()
    p = (A * q.float()[:, None, :, None]).sum(2) / n.clamp_min(1)[:, None, None]
    return p, n > 0


def key_marginal_entropy(A, query_mask=None, normalized: bool = False, **masks) -> torch.Tensor:
    """H_km per head (H,); `normalized` divides by log L_t (L_t = valid keys of the sequence)."""
    p, has = key_marginal(A, query_mask, **masks)
    h = -_xlogx(p).sum(-1)  # (B, H)
    if normalized:
        _, _, keys, _, _, _ = _prepare(A, **masks)
        n = keys.sum(-1).float()[:, None]
        h = torch.where(n > 1, h / torch.log(n.clamp_min(2)), torch.zeros((), device=h.device))
    return h[has].mean(0) if has.any() else torch.zeros(h.shape[1], device=h.device)


def colsum_concentration(A, **masks) -> torch.Tensor:
    """C = 1 − H_col per head (H,), H_col = −(1/log T) Σ_j ĉ_j log ĉ_j, ĉ_j = (Σ_i A_ij)/T over valid rows.
    With Q = all rows and T keys, H_col = H_km / log T: one implementation, two names."""
    p, has = key_marginal(A, None, **masks)  # ĉ_j = c_j / T
    _, rows, _, _, _, _ = _prepare(A, **masks)
    T = rows.sum(-1).float()[:, None]
    h = -_xlogx(p).sum(-1)
    h_col = torch.where(T > 1, h / torch.log(T.clamp_min(2)), torch.zeros((), device=h.device))
    c = 1.0 - h_col
    return c[has].mean(0) if has.any() else torch.zeros(c.shape[1], device=c.device)


def _sink_index(keys: torch.Tensor, k) -> torch.Tensor:
    """Key column of the sink per sequence: `k`-th valid key (default the first token)."""
    idx = torch.arange(keys.shape[1], device=keys.device)
    order = torch.where(keys, idx, torch.full_like(idx, keys.shape[1])).sort(-1).values
    return order[:, k].clamp(max=keys.shape[1] - 1)


def sink_score(A, k: int = 0, **masks) -> torch.Tensor:
    """sink score (B, H) = (1/T) Σ_i A_ik, k = the k-th valid key (the first token by default)."""
    p, _ = key_marginal(A, None, **masks)
    _, _, keys, _, _, _ = _prepare(A, **masks)
    col = _sink_index(keys, k)
    return p.gather(2, col[:, None, None].expand(p.shape[0], p.shape[1], 1)).squeeze(-1)


def sink_rate(A, tau: float = 0.3, k: int = 0, **masks) -> torch.Tensor:
    """sink rate (scalar): fraction of heads with sink score ≥ τ, averaged over sequences."""
    s = sink_score(A, k, **masks)
    _, rows, _, _, _, _ = _prepare(A, **masks)
    has = rows.any(-1)
    rate = (s >= tau).float().mean(-1)
    return rate[has].mean() if has.any() else torch.zeros((), device=s.device)


def lam_window(r_t: float = 1.0, gamma: float = 32) -> int:
    """M_t = ⌈γ · r_t⌉ (backward window in the loop's own coordinates, diagonal included)."""
    return max(1, math.ceil(gamma * r_t - 1e-9))


def local_attention_mass(A, r_t: float = 1.0, gamma: float = 32, query_mask=None, **masks) -> torch.Tensor:
    """LAM per head (H,): mean over the query set of Σ_{i−M<j≤i} A_ij, M = ⌈γ r_t⌉."""
    A, rows, _, _, qp, kp = _prepare(A, **masks)
    M = lam_window(r_t, gamma)
    d = qp[:, :, None] - kp[:, None, :]
    window = (d >= 0) & (d < M)
    mass = (A * window[:, None].float()).sum(-1)  # (B, H, Tq)
    q = rows if query_mask is None else rows & query_mask.to(rows.device).bool()
    return _mean_rows(mass, q)


def dynamic_heads(metric_by_loop, frac: float = 0.4, scope: str = "global") -> dict:
    """`metric_by_loop` (R, L, H) → the top ⌈frac · #heads⌉ (layer, head) pairs by range max_t − min_t.

    scope "global" ranks all pairs together, "layer" within each layer. Returns `mask` (L, H) bool, `range` (L, H)
    and `curve` (R,): the per-loop metric averaged over the selected heads."""
    m = torch.as_tensor(metric_by_loop).float()
    if m.dim() == 2:
        m = m[:, None]
    R, L, H = m.shape
    rng = m.amax(0) - m.amin(0)
    mask = torch.zeros(L, H, dtype=torch.bool)
    if scope == "global":
        k = math.ceil(frac * L * H)
        top = rng.flatten().topk(k).indices
        mask.view(-1)[top] = True
    elif scope == "layer":
        k = math.ceil(frac * H)
        for ell in range(L):
            mask[ell, rng[ell].topk(k).indices] = True
    else:
        raise ValueError(f"scope must be 'global' or 'layer', got {scope!r}")
    curve = (m * mask.float()).sum((1, 2)) / mask.sum().clamp_min(1)
    return {"mask": mask, "range": rng, "curve": curve}


def attention_distance(A1, A2, normalize: str | None = None, **masks) -> torch.Tensor:
    """‖A − A'‖_F over the valid block, mean over heads then sequences; `normalize="rows"` divides by √T."""
    a1, rows, keys, _, _, _ = _prepare(A1, **masks)
    a2, _, _, _, _, _ = _prepare(A2, **masks)
    if a1.shape != a2.shape:
        raise ValueError(f"attention distance needs matrices of equal shape, got {tuple(a1.shape)} and "
                         f"{tuple(a2.shape)} (recurrences at different resolutions are not comparable)")
    block = (rows[:, :, None] & keys[:, None, :]).float()[:, None]
    d = (((a1 - a2) * block) ** 2).sum((-1, -2)).sqrt()  # (B, H)
    if normalize == "rows":
        d = d / rows.sum(-1).float().clamp_min(1).sqrt()[:, None]
    elif normalize is not None:
        raise ValueError(f"normalize must be None or 'rows', got {normalize!r}")
    has = rows.any(-1)
    return d[has].mean() if has.any() else torch.zeros(())


def attention_similarity_matrix(trace, normalize: str | None = None, chunk_size: int = 256) -> tuple:
    """cyclic similarity matrix D[(ℓ,t),(ℓ',t')] = ‖A^{ℓ,t} − A^{ℓ',t'}‖_F over every realised loop step that
    recorded attention with the same heads and shape. Returns (D (N, N), labels [(ℓ, t)])."""
    steps = [s for s in trace.loop_steps() if s.attention is not None]
    if not steps:
        raise ValueError("the trace holds no loop-step attention")
    ref = steps[0].attention
    steps = [s for s in steps if s.attention.shape == ref.shape
             and bool((s.attention.row_valid == ref.row_valid).all())]
    mats = common_head_weights([s.attention for s in steps], chunk_size)
    masks = ref.masks()
    masks.pop("visible")  # the union of supports: each matrix is already zero where it cannot see
    n = len(mats)
    D = torch.zeros(n, n)
    for a in range(n):
        for b in range(a + 1, n):
            D[a, b] = D[b, a] = attention_distance(mats[a], mats[b], normalize=normalize,
                                                   visible=torch.ones_like(ref.visible), **masks)
    return D, [(s.layer, s.recurrence) for s in steps]


def attention_fixed_point_distance(trace, normalize: str | None = None) -> dict[int, torch.Tensor]:
    """‖A^{ℓ,t} − A^{ℓ,T_fp}‖_F for t = 1..R per loop layer ℓ (run the trace with R = T_fp recurrences); layers
    whose recurrences differ in shape are skipped. Heads: those every recurrence recorded."""
    out = {}
    for ell, steps in trace.by_layer().items():
        steps = [s for s in steps if s.attention is not None]
        if len(steps) < 2 or len({s.attention.shape for s in steps}) > 1:
            continue
        ws = common_head_weights([s.attention for s in steps])
        masks = steps[-1].attention.masks()
        masks.pop("visible")
        out[ell] = torch.stack([attention_distance(w, ws[-1], normalize=normalize, **masks) for w in ws])
    return out


def common_head_weights(records, chunk_size: int = 256) -> list[torch.Tensor]:
    """Weights of several `AttentionRecord`s restricted to the heads they all recorded (SGT: loops k ≥ 1 keep only
    the looped heads), in the same head order."""
    common = [h for h in records[0].heads if all(h in r.heads for r in records[1:])]
    if not common:
        raise ValueError("the attention records share no head")
    out = []
    for r in records:
        w = r.weights(chunk_size)
        if list(r.heads) != common:
            w = w[:, [r.heads.index(h) for h in common]]
        out.append(w)
    return out


def cross_iteration_mass(A, key_iter, num_streams: int | None = None, query_mask=None, exclude_keys=None,
                         **masks) -> tuple[torch.Tensor, torch.Tensor]:
    """(TaH2) mass on each key stream j: μ_j = Σ_{k: iter_k = j} A_qk, mean over the queries of a sequence, then
    over sequences. `exclude_keys` (B, Tk), e.g. the prompt, is dropped without renormalising.
    Returns (mean (H, S), sample std over sequences (H, S))."""
    A, rows, keys, _, _, _ = _prepare(A, **masks)
    key_iter = key_iter.to(A.device).long()
    S = int(key_iter.max()) + 1 if num_streams is None else num_streams
    keep = keys if exclude_keys is None else keys & ~exclude_keys.to(A.device).bool()
    onehot = torch.nn.functional.one_hot(key_iter.clamp(0, S - 1), S).float() * keep.float()[..., None]  # (B, Tk, S)
    mass = torch.einsum("bhqk,bks->bhqs", A, onehot)
    q = rows if query_mask is None else rows & query_mask.to(rows.device).bool()
    w = q.float()[:, None, :, None]
    per_seq = (mass * w).sum(2) / w.sum(2).clamp_min(1)  # (B, H, S)
    has = q.any(-1)
    per_seq = per_seq[has]
    mean = per_seq.mean(0)
    std = per_seq.std(0, unbiased=True) if per_seq.shape[0] > 1 else torch.zeros_like(mean)
    return mean, std


__all__ = ["attention_distance", "attention_entropy", "attention_fixed_point_distance", "attention_similarity_matrix", "colsum_concentration",
           "common_head_weights",
           "cross_iteration_mass", "dynamic_heads", "key_marginal", "key_marginal_entropy", "lam_window",
           "local_attention_mass", "mixing_score", "row_entropy", "sink_rate", "sink_score"]
