"""Accuracy vs log2(decoding FLOPs): slope fitting, matched-compute interpolation and cons@n (docs/analysis.md).

Recorded responses are dicts with `tokens` (generated ids), `depths` (the depth the model ran when each generated
token was fed back, i.e. the cache's `token_depth` of that position), optionally `prompt_streams` (streams kept per
prompt position, from the prefill record) and whatever the scorer needs. A response cut at c tokens is decoded with
min(c, len) − 1 decode calls (the first token comes from the prefill), fed tokens u = 0 .. min(c, len) − 2.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..core.flops_tah2 import decode_flops_tah2

PAPER_CUTOFFS = tuple(range(4096, 16385, 2048))
EXTENDED_CUTOFFS = (4096, 6144, 8192, 12288, 16384, 20480, 24576, 28672, 32768)


class ScalingFit(NamedTuple):
    slope: float  # accuracy points per doubling of decoding FLOPs
    intercept: float
    r2: float
    stderr: float  # standard error of the slope


def fit_scaling_slope(flops: Sequence[float], acc: Sequence[float]) -> ScalingFit:
    """OLS acc = a + b · log2 F. Needs ≥ 2 points with distinct FLOPs (stderr needs ≥ 3; NaN otherwise)."""
    if len(flops) != len(acc):
        raise ValueError(f"flops and acc must have equal lengths, got {len(flops)} and {len(acc)}")
    if any(f <= 0 for f in flops):
        raise ValueError("FLOPs must be positive")
    x = [math.log2(f) for f in flops]
    n = len(x)
    if n < 2:
        raise ValueError("a slope needs at least 2 points")
    mx, my = sum(x) / n, sum(acc) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    if sxx == 0:
        raise ValueError("all points have the same FLOPs: the slope is undefined")
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, acc, strict=True)) / sxx
    a = my - b * mx
    ss_res = sum((yi - (a + b * xi)) ** 2 for xi, yi in zip(x, acc, strict=True))
    ss_tot = sum((yi - my) ** 2 for yi in acc)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    stderr = math.sqrt(ss_res / (n - 2) / sxx) if n > 2 else float("nan")
    return ScalingFit(b, a, r2, stderr)


def interpolate_accuracy(flops: Sequence[float], acc: Sequence[float], query: float) -> float:
    """Matched compute: linear interpolation of accuracy in log2 F between measured points; never extrapolates."""
    pts = sorted(zip((math.log2(f) for f in flops), acc, strict=True))
    q = math.log2(query)
    if not pts or q < pts[0][0] - 1e-12 or q > pts[-1][0] + 1e-12:
        raise ValueError(f"{query:.4g} FLOPs lies outside the measured range "
                         f"[{2 ** pts[0][0]:.4g}, {2 ** pts[-1][0]:.4g}]: no extrapolation")
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= q <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (q - x0) / (x1 - x0)
    return pts[0][1]


def tah2_response_flops(config, response: dict, cutoff: int) -> float:
    """Decoding FLOPs of one response cut at `cutoff` tokens (`hf_loops.core.flops_tah2`)."""
    n = min(cutoff, len(response["tokens"]))
    depths = list(response["depths"])[: max(n - 1, 0)]
    return decode_flops_tah2(config, depths, list(response.get("prompt_streams", [])),
                             max_iterations=getattr(config, "max_iterations", None) or max(depths, default=1))


def accuracy_vs_flops(responses: Sequence[dict], cutoffs: Sequence[int], score: Callable[[list, dict], float],
                      flops: Callable[[dict, int], float]) -> list[dict]:
    """For every cutoff c: truncate each response at c tokens, re-score it (`score(tokens, response)` in [0, 1]) and
    average; mean decoding FLOPs per response. Returns a tidy table [{cutoff, accuracy, flops, n}]."""
    if not responses:
        raise ValueError("no recorded responses")
    rows = []
    for c in cutoffs:
        acc = [float(score(list(r["tokens"])[:c], r)) for r in responses]
        fl = [float(flops(r, c)) for r in responses]
        rows.append({"cutoff": c, "accuracy": 100.0 * sum(acc) / len(acc), "flops": sum(fl) / len(fl),
                     "n": len(responses)})
    return rows


def peak_accuracy(table: Sequence[dict]) -> dict:
    """The row with the highest accuracy over cutoffs."""
    return max(table, key=lambda r: r["accuracy"])


def cons_at_n(answers: Sequence[Sequence], gold: Sequence, n: int, draws: int = 100, seed: int = 0) -> float:
    """Parallel scaling: majority vote over n responses drawn without replacement (ties: the earliest drawn),
    averaged over `draws` random draws and over problems; in percent."""
    rng = random.Random(seed)
    total = 0.0
    for per_problem, truth in zip(answers, gold, strict=True):
        if len(per_problem) < n:
            raise ValueError(f"cons@{n} needs at least {n} responses per problem, got {len(per_problem)}")
        hits = 0
        for _ in range(draws):
            votes = Counter(rng.sample(list(per_problem), n))
            hits += votes.most_common(1)[0][0] == truth
        total += hits / draws
    return 100.0 * total / max(len(gold), 1)


def cons_flops(per_response_flops: Sequence[float], n: int) -> float:
    """FLOPs of cons@n = n × the mean per-response cost."""
    return n * sum(per_response_flops) / max(len(per_response_flops), 1)


__all__ = ["EXTENDED_CUTOFFS", "PAPER_CUTOFFS", "ScalingFit", "accuracy_vs_flops", "cons_at_n", "cons_flops",
           "fit_scaling_slope", "interpolate_accuracy", "peak_accuracy", "tah2_response_flops"]
