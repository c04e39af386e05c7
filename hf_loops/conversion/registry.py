"""Architectures hf_loops can convert a Qwen3 checkpoint into: name → (config class, causal-LM class).

Each architecture's configuration subclasses `Qwen3Config`, so every Qwen3 field carries over and the Qwen3 weights
keep their state-dict names.
"""

from __future__ import annotations

from ..modeling.configuration_sgt import SGTConfig
from ..modeling.configuration_spiralformer import SpiralFormerConfig
from ..modeling.configuration_tah2 import TaH2Config
from ..modeling.modeling_sgt import SGTForCausalLM
from ..modeling.modeling_spiralformer import SpiralFormerForCausalLM
from ..modeling.modeling_tah2 import TaH2ForCausalLM

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "tah2": (TaH2Config, TaH2ForCausalLM),
    "spiralformer": (SpiralFormerConfig, SpiralFormerForCausalLM),
    "sgt": (SGTConfig, SGTForCausalLM),
}


def get_architecture(arch: str) -> tuple[type, type]:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}") from None
