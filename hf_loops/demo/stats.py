"""The demo's numbers over seeds: per-seed values and ratios to Standard (`aggregate`), process CPU time, the mean ± std
tables and what they say about the claim (`verdict`)."""

from __future__ import annotations

import statistics

from ..data import arithmetic as A
from .settings import ARCHS


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(values, spec=".3f", scale=1.0) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m, s = spread([v * scale for v in values])
    return f"{m:{spec}} ± {s:{spec}}"


def aggregate(runs: dict[str, list[dict]]) -> dict:
    """Per arch: the per-seed values and their mean/spread, ratios to Standard taken seed by seed."""
    std = {r["seed"]: r for r in runs["standard"]}
    out = {}
    for arch, rs in runs.items():
        rows = []
        for r in rs:
            m, base = r["metrics"], std[r["seed"]]["metrics"]
            rows.append({
                "seed": r["seed"], "exact_match": m["exact_match"], "answer_nll": m["answer_nll"],
                "mean_depth": m.get("mean_depth") or 1.0, "mean_depth_generated": m.get("mean_depth_generated") or 1.0,
                "flops_ratio": m["decode_flops_per_token"] / base["decode_flops_per_token"],
                "train_ratio": r["train_runtime"] / std[r["seed"]]["train_runtime"],
                "deep_share": r["class_shares"],
            })
        out[arch] = rows
    return out


def cpu_summary(runs: dict[str, list[dict]]) -> dict:
    """Process CPU seconds of the runs (`run_job`'s "cpu_seconds"): per arch the mean per run of each phase, and the
    total of every run and phase."""
    out = {"per_run_mean": {}, "total": 0.0}
    for arch, rs in runs.items():
        cs = [r["cpu_seconds"] for r in rs if r.get("cpu_seconds")]
        if cs:
            # 3 decimals: a tiny run's evaluation takes under 0.05 s, which one decimal rounds to 0.0
            out["per_run_mean"][arch] = {k: round(statistics.fmean(c[k] for c in cs), 3) for k in cs[0]}
            out["total"] += sum(sum(c.values()) for c in cs)
    out["total"] = round(out["total"], 1)
    return out


def seed_table(agg: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "exact match (held out)", "answer NLL", "mean depth", "mean depth (generated)",
               "decode FLOPs ÷ Standard", "training time ÷ Standard"]
    rows = []
    for arch, label in ARCHS:
        rs = agg.get(arch)
        if not rs:
            continue
        rows.append([label, pm([r["exact_match"] for r in rs], ".1f", 100.0) + " %",
                     pm([r["answer_nll"] for r in rs]), pm([r["mean_depth"] for r in rs]),
                     pm([r["mean_depth_generated"] for r in rs]), pm([r["flops_ratio"] for r in rs], ".2f") + "×",
                     pm([r["train_ratio"] for r in rs], ".2f") + "×"])
    return headers, rows


def class_table(agg: dict, arch: str = "tah2") -> tuple[list[str], list[list[str]]]:
    """Share of deep tokens per token class (mean ± spread over seeds) and the token counts."""
    rs = agg.get(arch) or []
    rows = []
    for c in A.TOKEN_CLASSES:
        shares = [r["deep_share"][c]["deep_share"] for r in rs]
        n = rs[0]["deep_share"][c]["tokens"] if rs else 0
        if n:
            rows.append([c, str(n), pm(shares, ".1f", 100.0) + " %"])
    return ["token class", "tokens per run", "deep (2 passes)"], rows



def verdict(agg: dict) -> list[str]:
    """What the measured numbers say about the claim, with the spread; no claim beyond them."""
    def mean(arch, key):
        return statistics.fmean(r[key] for r in agg[arch])

    em = {a: [r["exact_match"] for r in agg[a]] for a in agg}
    wins = sum(t > s for t, s in zip(em["tah2"], em["standard"], strict=True))
    lines = [f"- **Exact match, TaH2 vs Standard:** {pm(em['tah2'], '.1f', 100.0)} % vs "
             f"{pm(em['standard'], '.1f', 100.0)} % (mean ± std over {len(em['tah2'])} seeds); TaH2 ahead in "
             f"{wins} of {len(em['tah2'])} seeds, at {mean('tah2', 'flops_ratio'):.2f}× Standard's decode FLOPs."]
    d_nll = mean("tah2", "answer_nll") - mean("standard", "answer_nll")
    lines.append(f"- **Answer NLL:** TaH2 {'lower' if d_nll < 0 else 'higher'} than Standard by {abs(d_nll):.3f} "
                 f"nats/token on average.")
    if "tah2-fixed" in agg:
        lines.append(f"- **TaH2-fixed** (every token at depth 2): exact match {pm(em['tah2-fixed'], '.1f', 100.0)} %, "
                     f"answer NLL {mean('tah2-fixed', 'answer_nll'):.3f}, at "
                     f"{mean('tah2-fixed', 'flops_ratio'):.2f}× decode FLOPs.")
    ahead = wins == len(em["tah2"]) and statistics.fmean(em["tah2"]) > statistics.fmean(em["standard"])
    lines.append("- **Verdict:** " + ("the claim held on this task, in every seed." if ahead else
                 "the claim did **not** hold on this task at this scale: TaH2 is not ahead of Standard in every "
                 "seed (numbers above)."))
    return lines


__all__ = ["aggregate", "class_table", "cpu_summary", "pm", "seed_table", "spread", "verdict"]
