"""What `hf-loops eval` (and the demo) show of results: the comparison table (markdown and console), the per-model
details, the pictures (depth map, depth by token class, loss curves) and the output directory with eval.json/eval.md."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

from ..core.outdir import atomic_output_dir


# ----------------------------------------------------------------------------------------------------- tables
def _fmt(x, spec=".3f", none="–"):
    return none if x is None else format(x, spec)


def comparison_rows(results: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table (baseline = results[0]): answer NLL, exact match, mean depth on the reference answers and
    on the generated tokens, decode FLOPs per token ÷ baseline, training time ÷ baseline, decider accuracy."""
    base = results[0]
    bf = base["metrics"].get("decode_flops_per_token")
    bt = (base.get("training") or {}).get("train_runtime")
    pattern = base.get("answer_pattern", "gsm8k")  # what "exact match" compared (results before it: gsm8k)
    pattern = {"gsm8k": "#### N", "last-number": "last number"}.get(pattern, pattern)
    headers = ["run", "answer NLL", f"exact match ({pattern})", "mean depth", "mean depth (generated)",
               f"decode FLOPs/token ÷ {base['name']}",
               f"training time ÷ {base['name']}", "decider acc."]
    rows = []
    for r in results:
        m = r["metrics"]
        f = m.get("decode_flops_per_token")
        t = (r.get("training") or {}).get("train_runtime")
        acc = m.get("decider_accuracy") or {}
        rows.append([
            r["name"],
            _fmt(m["answer_nll"]),
            f"{m['correct']}/{m['examples']} ({100 * m['exact_match']:.0f}%)",
            _fmt(m.get("mean_depth"), ".3f", "1 (no loop)"),
            _fmt(m.get("mean_depth_generated"), ".3f", "1 (no loop)"),
            f"{f / bf:.3f}×" if f and bf else "–",
            f"{t / bt:.2f}×" if t and bt else "–",
            " ".join(f"{_fmt(v, '.1%')}" for v in acc.values()) if acc else "–",
        ])
    return headers, rows


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def console_table(headers, rows) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def details_markdown(result: dict) -> str:
    """Everything else measured for one model, as markdown."""
    m = result["metrics"]
    lines = [f"### {result['name']}", "", f"- checkpoint: `{result.get('model') or '(in memory)'}` "
             f"({result['architecture']}, model_type `{result['model_type']}`)",
             f"- answer NLL {m['answer_nll']:.4f} nats/token over {m['answer_tokens']} assistant tokens; "
             f"perplexity {m['perplexity']:.2f}",
             f"- exact match {m['correct']}/{m['examples']} ({100 * m['exact_match']:.1f}%), greedy, "
             f"≤ {m['max_new_tokens']} new tokens",
             f"- decode FLOPs per token {_fmt(m['decode_flops_per_token'], '.4g')} over {m['decode_positions']} decode "
             f"positions; {m['generated_tokens']} tokens generated at {_fmt(m['tokens_per_s'], '.1f')} tokens/s "
             f"(batch {m['batch_size']})"]
    if m.get("mean_depth") is not None:
        hist = ", ".join(f"depth {k}: {v}" for k, v in m["depth_histogram"].items())
        cont = ", ".join(f"after depth {k}: {_fmt(v, '.1%')}" for k, v in m["continue_rate"].items()) or "–"
        lines += [f"- mean depth {m['mean_depth']:.3f} on the reference answers (teacher-forced; {hist}); "
                  f"{_fmt(m.get('mean_depth_generated'), '.3f')} on the generated tokens",
                  f"- continue rate {cont}"]
        if m.get("decider_accuracy"):
            acc = ", ".join(f"boundary {k}: {_fmt(v, '.1%')} of {m['decider_decisions'][k]} decisions"
                            for k, v in m["decider_accuracy"].items())
            lines.append(f"- decider accuracy against lookahead labels (per example, ρ = 0.99): {acc}")
        ds = m["deep_share"]
        lines.append("- share of deep tokens (depth ≥ 2): " + ", ".join(
            f"{g} {_fmt(v, '.1%')}" for g, v in ds.items()))
        lines += ["", "| token class | tokens | mean depth | deep share |", "|---|---|---|---|"]
        for c, s in m["depth_by_class"].items():
            lines.append(f"| {c} | {s['tokens']} | {_fmt(s['mean_depth'])} | {_fmt(s['deep_share'], '.1%')} |")
    if result.get("training"):
        t = result["training"]
        lines.append("")
        lines.append(f"- training: {t.get('steps')} steps in {_fmt(t.get('train_runtime'), '.1f')} s"
                     + (f"; final decider accuracy (train) {_fmt(t.get('decider_acc'), '.1%')}"
                        if t.get("decider_acc") is not None else ""))
    return "\n".join(lines)



# ----------------------------------------------------------------------------------------------------- pictures
def _gsm8k_spans(texts: list[str]) -> list[tuple[str, int, int]]:
    joined, start = "", None
    for i, t in enumerate(texts):
        joined += t
        if start is None and "####" in joined:
            start = i
            while start > 0 and "#" in texts[start - 1]:
                start -= 1
            break
    if start is None:
        return [("answer", 0, len(texts))]
    return [("reasoning", 0, start), ("final answer (#### N)", start, len(texts))]



def depth_rows(result: dict, limit: int | None = None):
    """Depth-map rows (`hf_loops.analysis.depth_map.DepthMapRow`) of a depth-reporting result's reference answers."""
    from ..analysis.depth_map import depth_map

    rows = []
    for e in result["examples"][:limit]:
        q = e["question"].replace("\n", " ")
        label = f"#{e['index'] + 1}: {q[:90]}{'…' if len(q) > 90 else ''}"
        rows.append(depth_map(e["answer_tokens"], e["answer_depths"], e["answer_continue_probs"],
                              special=e["answer_special"], spans=_gsm8k_spans(e["answer_tokens"]), label=label))
    return rows


def plot_loss_curves(runs: dict[str, list[dict]], path: str) -> None:
    """NTP loss and decider loss per step for every run (`runs`: name → Trainer log history)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)
    colors = ["#8fa3bf", "#c44e12", "#4c956c", "#7b2cbf"]
    for k, (name, history) in enumerate(runs.items()):
        steps = [h["step"] for h in history if "ntp_loss" in h or "loss" in h]
        ntp = [h.get("ntp_loss", h.get("loss")) for h in history if "ntp_loss" in h or "loss" in h]
        axes[0].plot(steps, ntp, label=name, color=colors[k % len(colors)], lw=1.4)
        dec = [(h["step"], h["decider_loss"]) for h in history if "decider_loss" in h]
        if dec:
            axes[1].plot([s for s, _ in dec], [v for _, v in dec], label=name, color=colors[k % len(colors)], lw=1.4)
    axes[0].set_title("next-token (NTP) loss per step", fontsize=10)
    axes[1].set_title("decider loss (weighted BCE) per step", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no run with a learned decider", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_pictures(results: Sequence[dict], out_dir: str, depth_map_examples: int | None = None) -> dict:
    """depth_map.html / .png (the deepest model), depth_by_token_class.png, loss_curves.png (if training logs).
    Returns {file: number of token boxes or None}."""
    from ..analysis.depth_map import plot_depth_by_class, render_html, render_png

    written = {}
    with_depth = [r for r in results if r["metrics"].get("mean_depth") is not None]
    if with_depth:
        looped = max(with_depth, key=lambda r: r["metrics"]["max_iterations"])
        M = looped["metrics"]["max_iterations"]
        rows = depth_rows(looped)
        note = (f"{looped['name']} on {len(rows)} held-out reference answers (teacher-forced). Each token is coloured "
                f"by the depth the model spent to predict it; mean depth {looped['metrics']['mean_depth']:.3f}.")
        with open(os.path.join(out_dir, "depth_map.html"), "w", encoding="utf-8") as f:
            f.write(render_html(rows, M, title=f"Per-token depth — {looped['name']}", note=note))
        written["depth_map.html"] = sum(len(r.tokens) for r in rows)
        shown = rows[: depth_map_examples or 4]
        written["depth_map.png"] = render_png(shown, M, os.path.join(out_dir, "depth_map.png"),
                                              title=f"Per-token depth — {looped['name']} (held-out answers)")
        plot_depth_by_class({r["name"]: r["metrics"]["depth_by_class"] for r in with_depth},
                            os.path.join(out_dir, "depth_by_token_class.png"))
        written["depth_by_token_class.png"] = None
    runs = {r["name"]: r["training"]["log_history"] for r in results
            if r.get("training") and r["training"].get("log_history")}
    if runs:
        plot_loss_curves(runs, os.path.join(out_dir, "loss_curves.png"))
        written["loss_curves.png"] = None
    return written



# ----------------------------------------------------------------------------------------------------- output
@contextlib.contextmanager
def output_dir(out: str, overwrite: bool = False, what: str = "--out"):
    """Yield a temporary directory; on success it becomes `out` (one rename, or the old `out` swapped out with
    `overwrite`), on failure it is removed; `out` is locked against a second run meanwhile (`core.outdir`)."""
    with atomic_output_dir(out, what, overwrite=overwrite, label=what) as tmp:
        yield tmp


def write_eval(results: Sequence[dict], out_dir: str, command: str | None = None) -> str:
    """eval.json + eval.md + pictures into `out_dir` (an existing empty directory). Returns the console table."""
    headers, rows = comparison_rows(results)
    with open(os.path.join(out_dir, "eval.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "results": list(results)}, f, indent=1)
    written = write_pictures(results, out_dir)
    md = ["# Evaluation", ""]
    if command:
        md += ["```", command, "```", ""]
    md += [markdown_table(headers, rows), ""]
    md += [details_markdown(r) + "\n" for r in results]
    md += ["Files: eval.json" + "".join(f", {k}" for k in written)]
    with open(os.path.join(out_dir, "eval.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    return console_table(headers, rows)



__all__ = ["comparison_rows", "console_table", "depth_rows", "details_markdown", "markdown_table", "output_dir",
           "plot_loss_curves", "write_eval", "write_pictures"]
