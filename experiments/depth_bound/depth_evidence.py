"""Evidence that depth is the bottleneck of the depth-bound task, at the plateau: 1 layer vs 2 layers vs 1 layer
applied twice, trained from scratch with the same data, steps schedule and seed; accuracy per difficulty level.

    PYTHONPATH=. python experiments/depth_bound/depth_evidence.py [--reuse] [--steps-deep 2500]

Each arm is `pretrain_base.py` (the 1-layer arm IS the base: its report is read from out/base when --reuse is
given; the others are trained with --no-save into out/evidence/<arm>). Writes out/evidence/evidence.json and
evidence.md: the validation curve of each arm and the per-level accuracy at its last (plateau) point.
"""

from __future__ import annotations

import argparse
import json
import os

import common as C
import pretrain_base

ARMS = {"L1": ["--layers", "1"], "L1x2": ["--layers", "1", "--looped", "2"], "L2": ["--layers", "2"]}


def report_path(arm: str) -> str:
    return os.path.join(C.OUT, "base" if arm == "L1" else os.path.join("evidence", arm), "pretrain_report.json")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reuse", action="store_true", help="read an arm's report if it exists instead of training it")
    p.add_argument("--steps-base", type=int, default=4000)
    p.add_argument("--steps-deep", type=int, default=2500)
    a = p.parse_args(argv)
    reports = {}
    for arm, args in ARMS.items():
        path = report_path(arm)
        if not (a.reuse and os.path.isfile(path)):
            steps = a.steps_base if arm == "L1" else a.steps_deep
            pretrain_base.main(args + ["--steps", str(steps)] + ([] if arm == "L1" else ["--no-save"]))
        with open(path, encoding="utf-8") as f:
            reports[arm] = json.load(f)
    levels = list(reports["L1"]["final"]["level_accuracy"])
    lines = ["| arm | params | steps | train s | val exact match | " + " | ".join(
        f"level {k}" for k in levels) + " |", "|" + "---|" * (5 + len(levels))]
    for arm, r in reports.items():
        f = r["final"]
        lines.append(f"| {arm} | {r['n_params']} | {r['steps']} | {r['train_seconds']:.0f} | "
                     f"{100 * f['exact_match']:.1f} % | " + " | ".join(
                         f"{100 * f['level_accuracy'][k]:.1f}" for k in levels) + " |")
    tokens = reports["L1"]["final"]["level_tokens"]
    lines.append("")
    lines.append("Validation tokens per level: " + ", ".join(f"{k}: {v}" for k, v in tokens.items()))
    lines.append("")
    lines.append("Validation exact match along training (step: L1 / L1x2 / L2):")
    by_step = {}
    for arm, r in reports.items():
        for pt in r["curve"]:
            by_step.setdefault(pt["step"], {})[arm] = pt["exact_match"]
    for step in sorted(by_step):
        row = by_step[step]
        lines.append(f"- {step}: " + " / ".join(f"{100 * row[a]:.1f}" if a in row else "–" for a in ARMS))
    os.makedirs(os.path.join(C.OUT, "evidence"), exist_ok=True)
    C.dump(os.path.join(C.OUT, "evidence", "evidence.json"),
           {arm: {k: r[k] for k in ("arm", "n_params", "steps", "train_seconds", "final", "curve", "settings")}
            for arm, r in reports.items()})
    with open(os.path.join(C.OUT, "evidence", "evidence.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
