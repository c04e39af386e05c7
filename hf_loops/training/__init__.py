"""Training wing: the TaH2 SFT trainer (lookahead depth supervision), SGT's growth schedule, labels, recipes.

    from hf_loops.training import TaH2SFTTrainer, TaH2SFTConfig, SGTGrowthCallback

Names load on first use, so `import hf_loops.training` does not import TRL (the `train` extra) until a trainer is
asked for.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TaH2SFTTrainer": ".tah2_trainer",
    "TaH2SFTConfig": ".tah2_trainer",
    "tah2_joint_loss": ".tah2_trainer",
    "metric_values": ".tah2_trainer",
    "SGTGrowthCallback": ".sgt_growth",
    "SGTGrowthScheduler": ".sgt_growth",
    "compute_depth_labels": ".tah2_labels",
    "decider_bce_sum": ".tah2_labels",
    "DepthLabels": ".tah2_labels",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
