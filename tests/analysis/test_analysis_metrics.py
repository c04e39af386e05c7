"""Analysis metrics on hand-built attention matrices and residual trajectories with known answers (analysis.md §9)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_loops.analysis import attention_metrics as am
from hf_loops.analysis import residual_metrics as rm
from hf_loops.analysis.slopes import cons_at_n, fit_scaling_slope, interpolate_accuracy
from hf_loops.analysis.tah2_depth import decider_gain_alignment, loss_change_fractions


def uniform_causal(T: int) -> torch.Tensor:
    i = torch.arange(T)
    allowed = (i[None, :] <= i[:, None]).float()
    return allowed / allowed.sum(-1, keepdim=True)


def one_hot_sink(T: int) -> torch.Tensor:
    A = torch.zeros(T, T)
    A[:, 0] = 1.0
    return A


def random_causal(B: int, H: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, T, T, generator=g) * 2
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)


def colsum_by_hand(A: torch.Tensor) -> float:
    """C = 1 + (1/log T) Σ_j ĉ_j log ĉ_j with ĉ_j = (Σ_i A_ij)/T, written out with Python floats."""
    T = A.shape[0]
    total = 0.0
    for j in range(T):
        c = sum(float(A[i, j]) for i in range(T)) / T
        if c > 0:
            total += c * math.log(c)
    return 1.0 + total / math.log(T)


# ---------------------------------------------------------------------------------------------------------------------
# §2 attention metrics
# ---------------------------------------------------------------------------------------------------------------------


def test_uniform_causal_rows_have_normalised_entropy_one():
    T = 9
    A = uniform_causal(T)
    h = am.row_entropy(A, normalized=True)[0, 0]
    assert h[0] == 0  # H̃_0 := 0 (one visible key)
    assert torch.allclose(h[1:], torch.ones(T - 1), atol=1e-6)
    assert am.attention_entropy(A, normalized=True).item() == pytest.approx((T - 1) / T, abs=1e-6)
    assert am.attention_entropy(A, rows="last", normalized=True).item() == pytest.approx(1.0, abs=1e-6)
    raw = am.mixing_score(A).item()
    assert raw == pytest.approx(sum(math.log(i + 1) for i in range(T)) / T, abs=1e-5)


def test_uniform_causal_colsum_and_key_marginal_by_formula():
    T = 7
    A = uniform_causal(T)
    C = am.colsum_concentration(A).item()
    assert C == pytest.approx(colsum_by_hand(A), abs=1e-6)
    # c_j = Σ_{i≥j} 1/(i+1): the harmonic tail
    p = [sum(1.0 / (i + 1) for i in range(j, T)) / T for j in range(T)]
    h_km = -sum(x * math.log(x) for x in p)
    assert am.key_marginal_entropy(A).item() == pytest.approx(h_km, abs=1e-6)
    assert am.key_marginal_entropy(A, normalized=True).item() == pytest.approx(h_km / math.log(T), abs=1e-6)


def test_one_hot_sink_column():
    T = 40
    A = one_hot_sink(T)[None].expand(3, T, T)  # three heads
    assert torch.allclose(am.colsum_concentration(A), torch.ones(3), atol=1e-6)
    assert torch.allclose(am.sink_score(A), torch.ones(1, 3))
    assert am.sink_rate(A).item() == 1.0
    # LAM = 1 only for the rows whose window still reaches key 0 (i < M = 32)
    assert torch.allclose(am.local_attention_mass(A, r_t=1.0), torch.full((3,), 32 / T))
    assert torch.allclose(am.local_attention_mass(A, r_t=1 / 8), torch.full((3,), 4 / T))


def test_key_marginal_entropy_identity_with_colsum():
    A = random_causal(2, 4, 11)
    h_norm = am.key_marginal_entropy(A, normalized=True)
    assert torch.allclose(h_norm, 1.0 - am.colsum_concentration(A), atol=1e-6)


@pytest.mark.parametrize("r_t, M", [(1, 32), (1 / 2, 16), (1 / 4, 8), (1 / 8, 4)])
def test_lam_window(r_t, M):
    assert am.lam_window(r_t) == M


def test_local_attention_mass_window_includes_diagonal():
    T = 6
    A = torch.eye(T)  # all mass on the diagonal
    assert am.local_attention_mass(A, gamma=1).item() == pytest.approx(1.0)
    B = torch.zeros(T, T)
    B[0, 0] = 1.0
    B[1:, 0] = 1.0  # mass on key 0; window M = 2 holds it only for rows 0 and 1
    assert am.local_attention_mass(B, gamma=2).item() == pytest.approx(2 / T)


def test_dynamic_heads_pick_the_largest_ranges():
    R = 4
    ranges = torch.tensor([0.1, 0.9, 0.3, 0.05, 0.7, 0.2, 0.8, 0.0, 0.6, 0.4])
    t = torch.linspace(0, 1, R)[:, None]
    metric = (t * ranges[None, :])[:, None, :]  # (R, L=1, H): head h ranges over [0, ranges[h]]
    out = am.dynamic_heads(metric)
    assert out["mask"][0].nonzero().flatten().tolist() == [1, 4, 6, 8]  # ⌈0.4 · 10⌉ = 4 heads
    assert torch.allclose(out["curve"], t.flatten() * (0.9 + 0.7 + 0.8 + 0.6) / 4)
    two_layers = torch.cat([metric, metric * 0.5], dim=1)
    per_layer = am.dynamic_heads(two_layers, scope="layer")["mask"]
    assert per_layer.sum(1).tolist() == [4, 4]
    assert am.dynamic_heads(two_layers)["mask"][1].sum() < 4  # global ranking favours the larger layer


def test_padding_never_changes_a_metric_and_batch_is_the_mean():
    T, pad = 6, 3
    A = random_causal(1, 2, T, seed=1)
    P = torch.rand(1, 2, T + pad, T + pad)  # garbage everywhere, then the real block in the lower right
    P[..., pad:, pad:] = A
    valid = torch.zeros(1, T + pad, dtype=torch.bool)
    valid[:, pad:] = True
    masks = {"row_mask": valid, "key_mask": valid}
    pos = (torch.arange(T + pad) - pad)[None]
    funcs = [
        lambda X, **m: am.attention_entropy(X, normalized=True, **m),
        lambda X, **m: am.attention_entropy(X, rows="last", normalized=True, **m),
        lambda X, **m: am.key_marginal_entropy(X, normalized=True, **m),
        lambda X, **m: am.colsum_concentration(X, **m),
        lambda X, **m: am.sink_score(X, **m),
        lambda X, **m: am.mixing_score(X, **m),
        lambda X, **m: am.local_attention_mass(X, gamma=2, **m),
    ]
    for f in funcs:
        assert torch.allclose(f(P, query_pos=pos, key_pos=pos, **masks), f(A), atol=1e-6)
    B2 = random_causal(1, 2, T, seed=2)
    both = torch.cat([A, B2])
    for f in funcs[:4] + funcs[5:]:
        assert torch.allclose(f(both), (f(A) + f(B2)) / 2, atol=1e-6)


def test_attention_distance():
    A, B = random_causal(1, 2, 5, 3), random_causal(1, 2, 5, 4)
    assert am.attention_distance(A, A).item() == 0.0
    d = am.attention_distance(A, B).item()
    assert d == pytest.approx(float(((A - B) ** 2).sum((-1, -2)).sqrt().mean()), abs=1e-6)
    assert am.attention_distance(A, B, normalize="rows").item() == pytest.approx(d / math.sqrt(5), abs=1e-6)
    with pytest.raises(ValueError, match="equal shape"):
        am.attention_distance(A, random_causal(1, 2, 6))


def test_cross_iteration_mass_sums_per_stream_without_renormalising():
    # 2 queries, 4 keys: streams [0, 0, 1, 1]; key 0 is a prompt key to drop
    A = torch.tensor([[0.5, 0.2, 0.3, 0.0], [0.1, 0.1, 0.4, 0.4]])[None, None]
    key_iter = torch.tensor([[0, 0, 1, 1]])
    vis = torch.ones(1, 2, 4, dtype=torch.bool)
    mean, std = am.cross_iteration_mass(A, key_iter, visible=vis)
    assert torch.allclose(mean[0], torch.tensor([(0.7 + 0.2) / 2, (0.3 + 0.8) / 2]))
    prompt = torch.tensor([[True, False, False, False]])
    mean, _ = am.cross_iteration_mass(A, key_iter, exclude_keys=prompt, visible=vis)
    assert torch.allclose(mean[0], torch.tensor([(0.2 + 0.1) / 2, (0.3 + 0.8) / 2]))


# ---------------------------------------------------------------------------------------------------------------------
# §3 residual metrics
# ---------------------------------------------------------------------------------------------------------------------


def trajectory(fn, R=64, N=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, N, D, generator=g)
    return torch.stack([fn(t, x0) for t in range(R)])  # (R, 1, N, D)


def test_constant_sequence_is_a_fixed_point():
    X = trajectory(lambda t, x0: x0)
    out = rm.classify_limiting_behaviour(X)
    assert out["fractions"]["fixed_point"] == 1.0
    assert torch.allclose(rm.successive_difference(X), torch.zeros(X.shape[0] - 1))


def test_period_two_sequence_is_an_orbit():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    X = trajectory(lambda t, x0: a if t % 2 == 0 else b)
    out = rm.classify_limiting_behaviour(X)
    assert out["counts"]["orbit"] == 3
    assert all(p == pytest.approx(2.0) for p in out["orbit_periods"])


def test_rotation_is_an_orbit():
    def rotate(t, x0):
        angle = 2 * math.pi * t / 8
        c, s = math.cos(angle), math.sin(angle)
        y = x0.clone()
        y[..., 0], y[..., 1] = c * x0[..., 0] - s * x0[..., 1], s * x0[..., 0] + c * x0[..., 1]
        return y * 0 + torch.nn.functional.pad(y[..., :2], (0, 6))  # the rotating plane only

    out = rm.classify_limiting_behaviour(trajectory(rotate))
    assert out["fractions"]["orbit"] == 1.0
    assert all(p == pytest.approx(8.0) for p in out["orbit_periods"])


def test_monotone_drift_is_a_slider():
    # a drift along an arc: the direction keeps moving one way (a straight-line drift x0 + t·v converges in
    # direction, which the cosine rule rightly calls a fixed point)
    R = 64

    def drift(t, x0):
        angle = math.pi * t / R
        return torch.nn.functional.pad(torch.tensor([math.cos(angle), math.sin(angle)]), (0, 6)).expand(1, 3, 8)

    assert rm.classify_limiting_behaviour(trajectory(drift, R=R))["fractions"]["slider"] == 1.0


def test_contracting_map_converges():
    X = trajectory(lambda t, x0: x0 * (1 + 0.5 ** t))
    diff = rm.successive_difference(X[:20])
    assert bool((diff[1:] < diff[:-1]).all())
    fp = rm.fixed_point_distance(X)
    assert bool((fp["distance"][1:20] < fp["distance"][:19]).all())
    assert fp["distance"][-1] == 0 and fp["cosine"][-1] == pytest.approx(1.0)
    assert rm.classify_limiting_behaviour(X)["fractions"]["fixed_point"] == 1.0


def test_successive_cosine_and_relative():
    X = torch.stack([torch.ones(1, 2, 4), 2 * torch.ones(1, 2, 4), -2 * torch.ones(1, 2, 4)])
    assert torch.allclose(rm.successive_difference(X, kind="cosine"), torch.tensor([1.0, -1.0]))
    assert torch.allclose(rm.successive_difference(X, kind="relative"), torch.tensor([1.0, 2.0]))


def test_degenerate_score():
    x = torch.randn(1, 5, 8)
    assert rm.degenerate_fixed_point_score(torch.stack([x, 2 * x, 3 * x])) == pytest.approx(1.0, abs=1e-6)
    cyc = torch.stack([x, -x])
    assert rm.degenerate_fixed_point_score(cyc) == pytest.approx(-1.0, abs=1e-6)


def test_matrix_entropy():
    u, v = torch.randn(10, 1), torch.randn(1, 6)
    assert rm.matrix_entropy(u @ v).item() == pytest.approx(0.0, abs=1e-5)  # rank 1
    q = torch.linalg.qr(torch.randn(6, 6)).Q  # equal singular values
    assert rm.matrix_entropy(q, normalized=True).item() == pytest.approx(1.0, abs=1e-5)
    valid = torch.tensor([[False, False] + [True] * 10])
    padded = torch.cat([torch.randn(2, 6), u @ v])[None]
    assert rm.matrix_entropy(padded, valid).item() == pytest.approx(0.0, abs=1e-5)


def test_residual_norm_and_similarity():
    X = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])
    n = rm.residual_norm(X)
    assert n["mean"].item() == pytest.approx(3.0) and n["first"].item() == pytest.approx(5.0)
    S = rm.residual_similarity_matrix([X, 2 * X, -X])
    assert torch.allclose(S, torch.tensor([[1.0, 1, -1], [1, 1, -1], [-1, -1, 1]]), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# §5 TaH2 depth tools, §6 slopes
# ---------------------------------------------------------------------------------------------------------------------


def test_decider_gain_alignment_bins():
    g = torch.tensor([0.01, 0.02, 0.51, 0.99, float("nan")])
    l1 = torch.tensor([1.0, 1.0, 2.0, 3.0, 9.0])
    l2 = torch.tensor([1.5, 0.5, 1.0, 1.0, 0.0])
    rows = decider_gain_alignment(g, l1, l2)
    assert len(rows) == 20
    assert rows[0]["count"] == 2 and rows[0]["mean_gain"] == pytest.approx(0.0)
    assert rows[10]["count"] == 1 and rows[10]["mean_gain"] == pytest.approx(1.0)
    assert rows[19]["mean_gain"] == pytest.approx(2.0)
    assert rows[5]["mean_gain"] is None and sum(r["count"] for r in rows) == 4


def test_loss_change_fractions():
    fr = loss_change_fractions(torch.tensor([-0.5, -1e-4, 0.0, 2e-3]))
    assert (fr["worse"], fr["little"], fr["improved"]) == (0.25, 0.5, 0.25)


def test_slope_fit_recovers_exact_line_and_interpolation_refuses_extrapolation():
    flops = [2.0 ** k for k in (10, 11, 13, 14)]
    acc = [5.0 + 2.5 * math.log2(f) for f in flops]
    fit = fit_scaling_slope(flops, acc)
    assert fit.slope == pytest.approx(2.5) and fit.intercept == pytest.approx(5.0)
    assert fit.r2 == pytest.approx(1.0) and fit.stderr == pytest.approx(0.0, abs=1e-9)
    assert interpolate_accuracy(flops, acc, 2.0 ** 12) == pytest.approx(5.0 + 2.5 * 12)
    with pytest.raises(ValueError, match="outside the measured range"):
        interpolate_accuracy(flops, acc, 2.0 ** 15)
    noisy = fit_scaling_slope(flops, [a + e for a, e in zip(acc, (0.3, -0.2, 0.1, -0.4), strict=False)])
    assert 0 < noisy.r2 < 1 and noisy.stderr > 0


def test_cons_at_n():
    assert cons_at_n([["a", "a", "b"], ["x", "y", "y"]], ["a", "y"], n=3) == 100.0
    assert cons_at_n([["a", "b"]], ["a"], n=1, draws=2000) == pytest.approx(50.0, abs=5)


@pytest.mark.slow
def test_plots_write_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_loops.analysis import plots

    table = [{"step": i, "stage": s, "recurrence": t, "layer": ell, "value": float(i)}
             for i, (s, t, ell) in enumerate([("pre", None, 1), ("loop", 1, 1), ("loop", 1, 2), ("loop", 2, 1),
                                               ("loop", 2, 2), ("post", None, 1)])]
    for g in plots.GROUPINGS:
        fig, rows = plots.plot_metric(table, g)
        assert rows is table
        paths = plots.save_figure(fig, str(tmp_path / f"m_{g}"))
        assert [p.rsplit(".", 1)[1] for p in paths] == ["png", "svg"]
        assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 0 for p in paths)
    with pytest.raises(ValueError, match="grouping"):
        plots.plot_metric(table, "bogus")


def test_entropy_row_subsets():
    A = random_causal(2, 3, 80, seed=7)
    last = am.attention_entropy(A, rows="last", normalized=True)
    assert torch.allclose(am.attention_entropy(A, rows=1, normalized=True), last)
    few = am.attention_entropy(A, rows=4, normalized=True)  # the last row + 3 rows spread over positions ≥ 64
    h = am.row_entropy(A, normalized=True)
    picked = h[..., [66, 71, 76, 79]].mean(-1).mean(0)  # 64 + ⌊(k + ½)·15/3⌋, k = 0..2, and the last row
    assert torch.allclose(few, picked, atol=1e-6)


def test_accuracy_vs_flops_from_recorded_depths():
    from helpers.common import tiny_qwen3_config

    from hf_loops.analysis.slopes import accuracy_vs_flops, tah2_response_flops

    cfg = tiny_qwen3_config()
    cfg.max_iterations = 2
    responses = [{"tokens": list(range(10)), "depths": [1, 2] * 5, "prompt_streams": [1, 1, 2], "answer": 3},
                 {"tokens": list(range(4)), "depths": [2, 2, 2, 2], "prompt_streams": [2, 2], "answer": 9}]
    table = accuracy_vs_flops(responses, [2, 4, 8], score=lambda toks, r: float(r["answer"] in toks),
                              flops=lambda r, c: tah2_response_flops(cfg, r, c))
    assert [row["accuracy"] for row in table] == [0.0, 50.0, 50.0]
    assert table[0]["flops"] < table[1]["flops"] < table[2]["flops"]


def test_plots_need_matplotlib(monkeypatch):
    import sys

    from hf_loops.analysis import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"hf_loops\[plot\]"):
        plots.plot_metric([], "none")
