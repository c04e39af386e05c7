"""Converters: Qwen3 → looped architectures, and export with remote code."""

from .convert import convert_qwen3, qwen3_config_fields
from .export import export, remote_code_saving
from .registry import ARCHITECTURES, get_architecture

__all__ = ["ARCHITECTURES", "convert_qwen3", "export", "get_architecture", "qwen3_config_fields", "remote_code_saving"]
