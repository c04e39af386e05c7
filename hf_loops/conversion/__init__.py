"""Converters: Qwen3 → looped architectures, the authors' TaH2 layout, export with remote code + model card, push.

Public API: `convert_qwen3`, `export`, `push_to_hub`, `import_tah2`, `export_tah2`, `calibrate_sgt`, and the
architecture registry (`get_spec`, `ARCHITECTURES`). The helpers behind them live in the submodules.
"""

from .convert import convert_qwen3
from .export import export, push_to_hub
from .registry import ARCHITECTURES, ArchitectureSpec, get_spec
from .sgt import calibrate_sgt
from .tah2_official import export_tah2, import_tah2

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "calibrate_sgt",
    "convert_qwen3",
    "export",
    "export_tah2",
    "get_spec",
    "import_tah2",
    "push_to_hub",
]
