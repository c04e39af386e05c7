"""Converters: Qwen3 → looped architectures, the authors' TaH2 layout, export with remote code + model card, push."""

from .convert import convert_qwen3, load_qwen3_source, load_source_tokenizer, qwen3_config_fields
from .export import export, remote_code_saving
from .hub import push_folder, push_to_hub, resolve_source_dir
from .model_card import render_model_card
from .registry import ARCHITECTURES, get_architecture
from .report import conversion_report, format_report
from .sgt import calibrate_sgt
from .spiralformer import convert_spiralformer, resolve_layer_map
from .tah2_official import export_tah2, import_tah2

__all__ = [
    "ARCHITECTURES",
    "calibrate_sgt",
    "conversion_report",
    "convert_qwen3",
    "convert_spiralformer",
    "export",
    "export_tah2",
    "format_report",
    "get_architecture",
    "import_tah2",
    "load_qwen3_source",
    "load_source_tokenizer",
    "push_folder",
    "push_to_hub",
    "qwen3_config_fields",
    "remote_code_saving",
    "render_model_card",
    "resolve_layer_map",
    "resolve_source_dir",
]
