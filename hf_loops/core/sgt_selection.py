"""SGT's Algorithm 1 selection rules, written once for the growth scheduler and for calibration (docs/sgt.md).

Pure functions on plain Python numbers. Tie rule (one for both users, as the reference's stable descending sort over
layers in index order): equal layer scores rank the **lower** layer first, equal head entropies rank the **lower**
head index first. Growth goes deep-to-shallow by default (the paper);
`shallow_to_deep` and `lowest_entropy` are the paper's ablations.
"""

from __future__ import annotations

GROWTH_DIRECTIONS = ("deep_to_shallow", "shallow_to_deep")
HEAD_SELECTIONS = ("highest_entropy", "lowest_entropy")


def _sign(selection: str) -> float:
    if selection not in HEAD_SELECTIONS:
        raise ValueError(f"head_selection must be one of {list(HEAD_SELECTIONS)}, got {selection!r}")
    return -1.0 if selection == "highest_entropy" else 1.0


def top_layers(scores, excluded, count: int, selection: str = "highest_entropy") -> list[int]:
    """The `count` best-scoring layers outside `excluded` (mean head entropy; highest first, or lowest first for the
    ablation); ties: the lower layer first (the reference sorts layers in index order with a stable sort)."""
    sign = _sign(selection)
    eligible = [layer for layer in range(len(scores)) if layer not in set(excluded)]
    eligible.sort(key=lambda layer: (sign * float(scores[layer]), layer))
    return eligible[:count]


def next_layer(top, selected, direction: str = "deep_to_shallow") -> int | None:
    """The next layer to loop: among `top` layers not yet selected and not past the selected ones in the growth
    direction, the one nearest the starting end (deepest for deep-to-shallow); None when there is none."""
    if direction not in GROWTH_DIRECTIONS:
        raise ValueError(f"growth_direction must be one of {list(GROWTH_DIRECTIONS)}, got {direction!r}")
    if direction == "deep_to_shallow":
        candidates = [layer for layer in top if layer not in selected and (not selected or layer <= min(selected))]
        return max(candidates) if candidates else None
    candidates = [layer for layer in top if layer not in selected and (not selected or layer >= max(selected))]
    return min(candidates) if candidates else None


def rank_heads(entropy, heads, count: int, selection: str = "highest_entropy") -> list[int]:
    """The `count` heads of `heads` to keep (highest entropy, or lowest for the ablation; ties: lower index), sorted."""
    sign = _sign(selection)
    return sorted(sorted(heads, key=lambda h: (sign * float(entropy[h]), h))[:count])
