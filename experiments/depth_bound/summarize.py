"""Tables of out/retrofit/results.jsonl: one row per run, FLOPs taken seed by seed against the same tag's Standard.

    PYTHONPATH=. python experiments/depth_bound/summarize.py [--tags a,b] [--criteria TAG]

`--criteria TAG` checks the issue's done-when criteria on that tag's runs (validation split): TaH2 above Standard
in every seed and mean gain >= 2x the larger std; TaH2's gain >= 80 % of TaH2-fixed's at (flops_tah2 - 1) <= 0.6
(flops_fixed - 1), with TaH2-fixed priced both as `evaluate` prices it (TaH2 formula) and by Eq. 18; the hardest
level's deep share >= 3x the copy tokens'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import common as C


def load(tags=None):
    rows = [json.loads(line) for line in open(os.path.join(C.OUT, "retrofit", "results.jsonl"), encoding="utf-8")]
    return [r for r in rows if tags is None or r["tag"] in tags]


def table(rows) -> str:
    std = {(r["tag"], r["seed"]): r for r in rows if r["arch"] == "standard"}
    levels = sorted({k for r in rows for k in r["levels"] if k not in ("copy", "end")})
    head = ["tag", "arch", "seed", "steps", "lr", "α_D", "exact %", "mean depth", "FLOPs ÷ Std", "(Eq. 18)",
            "train s"] + [f"acc L{k}" for k in levels] + [f"deep L{k}" for k in levels] + ["deep copy"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = std.get((r["tag"], r["seed"]))
        f = r["decode_flops_per_token"] / s["decode_flops_per_token"] if s else None
        f18 = (r["decode_flops_fixed_eq18_per_token"] / s["decode_flops_per_token"]
               if s and r.get("decode_flops_fixed_eq18_per_token") else None)
        st = r["settings"]
        lv = r["levels"]
        cells = [r["tag"], r["arch"], str(r["seed"]), str(st["max_steps"]), f"{st['learning_rate']:g}",
                 f"{st['decider_loss_weight']:g}", f"{100 * r['exact_match']:.1f}", f"{r['mean_depth']:.3f}",
                 f"{f:.3f}" if f else "–", f"{f18:.3f}" if f18 else "–", f"{r['train_wall_s']:.0f}"]
        cells += [f"{100 * lv[k]['greedy_char_acc']:.1f}" if k in lv else "–" for k in levels]
        cells += [f"{100 * (lv[k]['deep_share'] or 0):.0f}" if k in lv else "–" for k in levels]
        cells += [f"{100 * (lv['copy']['deep_share'] or 0):.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def criteria(rows, tag) -> list[str]:
    rs = [r for r in rows if r["tag"] == tag]
    by = {a: {r["seed"]: r for r in rs if r["arch"] == a} for a in ("standard", "tah2", "tah2-fixed")}
    seeds = sorted(set(by["standard"]) & set(by["tah2"]))
    em = {a: [by[a][s]["exact_match"] for s in seeds if s in by[a]] for a in by}
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
    gain = [t - s for t, s in zip(em["tah2"], em["standard"], strict=True)]
    lines = [f"seeds {seeds}; exact match Standard {em['standard']}, TaH2 {em['tah2']}, TaH2-fixed {em['tah2-fixed']}"]
    mg = statistics.fmean(gain)
    lines.append(f"1. TaH2 > Standard in every seed: {all(g > 0 for g in gain)}; mean gain {100 * mg:.2f} pts vs 2x "
                 f"larger std {200 * max(sd(em['standard']), sd(em['tah2'])):.2f} pts → "
                 f"{mg >= 2 * max(sd(em['standard']), sd(em['tah2']))}")
    if em["tah2-fixed"] and len(em["tah2-fixed"]) == len(seeds):
        fg = statistics.fmean(em["tah2-fixed"]) - statistics.fmean(em["standard"])
        ft = statistics.fmean(by["tah2"][s]["decode_flops_per_token"] / by["standard"][s]["decode_flops_per_token"]
                              for s in seeds)
        ff = statistics.fmean(by["tah2-fixed"][s]["decode_flops_per_token"] /
                              by["standard"][s]["decode_flops_per_token"] for s in seeds)
        f18 = statistics.fmean(by["tah2-fixed"][s]["decode_flops_fixed_eq18_per_token"] /
                               by["standard"][s]["decode_flops_per_token"] for s in seeds)
        lines.append(f"2. TaH2 gain {100 * mg:.2f} pts vs 80 % of TaH2-fixed's {100 * fg:.2f} pts → "
                     f"{fg > 0 and mg >= 0.8 * fg}; FLOPs TaH2 {ft:.3f}x, fixed {ff:.3f}x (evaluate) / {f18:.3f}x "
                     f"(Eq. 18): (t-1) <= 0.6 (f-1) → {ft - 1 <= 0.6 * (ff - 1)} / {ft - 1 <= 0.6 * (f18 - 1)}")
    levels = sorted(k for k in by["tah2"][seeds[0]]["levels"] if k not in ("copy", "end"))
    hard = levels[-1]
    for s in seeds:
        lv = by["tah2"][s]["levels"]
        h, c = lv[hard]["deep_share"], lv["copy"]["deep_share"]
        lines.append(f"3. seed {s}: deep share level {hard} {100 * h:.1f} % vs copy {100 * c:.2f} % → {h >= 3 * c}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tags", default=None)
    p.add_argument("--criteria", default=None)
    a = p.parse_args(argv)
    rows = load(a.tags.split(",") if a.tags else None)
    print(table(rows))
    if a.criteria:
        print("\n".join(criteria(rows, a.criteria)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
