"""Figures (docs/analysis.md). matplotlib is an optional extra: `pip install "hf_loops[plot]"`.

Every per-step metric is a tidy table: a list of dicts with `step` (realised depth index), `stage`, `recurrence`,
`layer` and `value`. `plot_metric` draws it three ways:

| grouping     | lines                 | x axis                                          | colormap |
| "none"       | one                   | realised depth index                            | one colour |
| "recurrence" | one per pass t        | relative depth (%) within the pass, pre/post at the ends | summer |
| "layer"      | one per loop layer ℓ  | recurrence t                                    | winter |

Each function returns `(figure, table)`; `save_figure` writes PNG and SVG.
"""

from __future__ import annotations

import math

GROUPINGS = ("none", "recurrence", "layer")


def _plt():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError('plots need matplotlib: pip install "hf_loops[plot]"') from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def as_dataframe(table):
    """The table as a pandas DataFrame when pandas is installed, else unchanged."""
    try:
        import pandas as pd
    except ImportError:
        return table
    return pd.DataFrame(table)


def save_figure(fig, stem: str) -> list[str]:
    """Write `stem`.png and `stem`.svg; returns the paths."""
    paths = []
    for ext in ("png", "svg"):
        path = f"{stem}.{ext}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    _plt().close(fig)
    return paths


def _colors(name: str, n: int):
    import matplotlib

    cmap = matplotlib.colormaps[name]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def plot_metric(table: list[dict], grouping: str = "none", ylabel: str = "value", title: str | None = None):
    """One per-step metric under one of the three groupings."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {list(GROUPINGS)}, got {grouping!r}")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rows = [r for r in sorted(table, key=lambda r: r["step"]) if _finite(r["value"])]
    if grouping == "none":
        ax.plot([r["step"] for r in rows], [r["value"] for r in rows], marker="o", ms=3, color="tab:blue")
        ax.set_xlabel("realised depth (step)")
    elif grouping == "recurrence":
        passes = sorted({r["recurrence"] for r in rows if r["stage"] == "loop"})
        pre = [r for r in rows if r["stage"] == "pre"]
        post = [r for r in rows if r["stage"] == "post"]
        for color, t in zip(_colors("summer", len(passes)), passes, strict=True):
            seq = pre + [r for r in rows if r["stage"] == "loop" and r["recurrence"] == t] + post
            xs = [100.0 * k / max(len(seq) - 1, 1) for k in range(len(seq))]
            ax.plot(xs, [r["value"] for r in seq], marker="o", ms=3, color=color, label=f"t={t}")
        ax.set_xlabel("relative depth within the pass (%)")
        if passes:
            ax.legend(fontsize=7, ncol=max(1, len(passes) // 8))
    else:
        layers = sorted({r["layer"] for r in rows if r["stage"] == "loop"})
        for color, ell in zip(_colors("winter", len(layers)), layers, strict=True):
            seq = sorted((r for r in rows if r["stage"] == "loop" and r["layer"] == ell), key=lambda r: r["recurrence"])
            ax.plot([r["recurrence"] for r in seq], [r["value"] for r in seq], marker="o", ms=3, color=color,
                    label=f"layer {ell}")
        ax.set_xlabel("recurrence t")
        if layers:
            ax.legend(fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} ({grouping})")
    ax.grid(alpha=0.3)
    return fig, table


def plot_loop_curves(panels: dict[str, dict[str, list[float]]], title: str = "per-loop attention statistics",
                     xlabels: list[str] | None = None):
    """One panel per statistic, one line per head selection, value vs loop t (the coarse-to-fine figure: H_km and
    LAM per loop). `panels` = {panel title: {line label: [value per loop]}}."""
    plt = _plt()
    names = list(panels)
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.6), squeeze=False)
    table = []
    for ax, name in zip(axes[0], names, strict=True):
        lines = panels[name]
        for color, (label, ys) in zip(("tab:green", "tab:orange", "tab:blue", "tab:red"), lines.items(), strict=False):  # at most 4 lines
            xs = list(range(1, len(ys) + 1))
            ax.plot(xs, ys, marker="o", color=color, label=label)
            table += [{"metric": name, "heads": label, "loop": x, "value": y} for x, y in zip(xs, ys, strict=True)]
            ax.set_xticks(xs)
            if xlabels:
                ax.set_xticklabels(xlabels, fontsize=8)
        ax.set_xlabel("loop t")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig, table


def plot_matrix(matrix, labels: list[str], title: str, cbar: str = ""):
    """Heatmap of a square matrix (attention distances, residual similarities)."""
    plt = _plt()
    n = len(labels)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * n + 2), max(3.5, 0.25 * n + 1.5)))
    im = ax.imshow([[float(v) for v in row] for row in matrix], cmap="viridis")
    step = max(1, n // 24)
    ax.set_xticks(range(0, n, step))
    ax.set_yticks(range(0, n, step))
    ax.set_xticklabels(labels[::step], rotation=90, fontsize=6)
    ax.set_yticklabels(labels[::step], fontsize=6)
    fig.colorbar(im, ax=ax, label=cbar)
    ax.set_title(title)
    table = [{"row": labels[a], "col": labels[b], "value": float(matrix[a][b])} for a in range(n) for b in range(n)]
    return fig, table


def plot_bars(names: list[str], values: list[float], errors: list[float] | None = None, title: str = "",
              ylabel: str = ""):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(names) + 2), 3.6))
    ax.bar(range(len(names)), values, yerr=errors, color="tab:blue", capsize=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    table = [{"name": n, "value": v, "error": (errors[i] if errors else None)} for i, (n, v) in
             enumerate(zip(names, values, strict=True))]
    return fig, table


def plot_decider_gain(rows: list[dict]):
    """mean gain of a second iteration per g⁽¹⁾ bin, with the token count."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = [(r["g_lo"] + r["g_hi"]) / 2 for r in rows if r["mean_gain"] is not None]
    ys = [r["mean_gain"] for r in rows if r["mean_gain"] is not None]
    ax.bar(xs, ys, width=0.045, color="tab:purple")
    ax.axhline(0, color="k", lw=0.8)
    ax.axvline(0.5, color="tab:red", ls="--", lw=0.8, label="τ = 0.5")
    ax.set_xlabel("continue probability g(1)")
    ax.set_ylabel("mean δ = ℓ(1) − ℓ(2)")
    ax.set_title("decider–gain alignment")
    ax.legend(fontsize=8)
    return fig, rows


def plot_loss_change_histogram(delta, fractions: dict, bins: int = 50):
    """histogram of Δ = ℓ(1) − ℓ(M) under forced depth, with the three fractions."""
    plt = _plt()
    d = [float(x) for x in delta]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.hist(d, bins=bins, color="tab:orange")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("Δ = ℓ(1) − ℓ(M)")
    ax.set_ylabel("tokens")
    ax.set_title(f"forced depth: worse {fractions['worse']:.1%}, little {fractions['little']:.1%}, "
                 f"improved {fractions['improved']:.1%}", fontsize=9)
    return fig, [{"delta": x} for x in d]


def plot_scaling(table: list[dict], fit=None, label: str = "model"):
    """accuracy vs log2 FLOPs per cutoff with the OLS line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    xs = [math.log2(r["flops"]) for r in table]
    ax.plot(xs, [r["accuracy"] for r in table], "o", label=label)
    if fit is not None and xs:
        lo, hi = min(xs), max(xs)
        ax.plot([lo, hi], [fit.intercept + fit.slope * lo, fit.intercept + fit.slope * hi], "-",
                label=f"slope {fit.slope:.2f}/doubling, R² {fit.r2:.3f}")
    ax.set_xlabel("log2 decoding FLOPs per response")
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig, table


__all__ = ["GROUPINGS", "as_dataframe", "plot_bars", "plot_decider_gain", "plot_loop_curves",
           "plot_loss_change_histogram", "plot_matrix", "plot_metric", "plot_scaling", "save_figure"]
