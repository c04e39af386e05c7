"""Moved to `hf_loops.core.sgt_selection` (conversion's calibration and training's growth scheduler share the rules,
and conversion sits below training); this name stays the very same module, so existing imports keep working."""

import sys

from ..core import sgt_selection as _moved

sys.modules[__name__] = _moved
