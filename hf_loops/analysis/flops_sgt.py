"""Moved to `hf_loops.core.flops_sgt` (FLOPs formulas are shared facts: training's SGT growth, conversion's registry and
the analyses all read them); this name stays the very same module, so existing imports keep working."""

import sys

from ..core import flops_sgt as _moved

sys.modules[__name__] = _moved
