"""vLLM general plugin (entry point group `vllm.general_plugins`): registers TaH2 and SGT with vLLM's model registry.

vLLM calls `register()` in every process it starts, so it must be idempotent and cheap; the model class is given by
its import path (vLLM imports it lazily) and the configuration class is registered with `AutoConfig` (importing
`hf_loops` does that) so vLLM can read a TaH2 export's `config.json`.
"""

from __future__ import annotations

MODELS = {
    "TaH2ForCausalLM": "hf_loops.serving.vllm_tah2:TaH2ForCausalLMvLLM",
    "SGTForCausalLM": "hf_loops.serving.vllm_sgt:SGTForCausalLMvLLM",
    # recognised, refused in one line (what to use instead)
    "SpiralFormerForCausalLM": "hf_loops.serving.vllm_tah2:SpiralFormerNotServed",
}


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from hf_loops.modeling.configuration_sgt import SGTConfig
    from hf_loops.modeling.configuration_spiralformer import SpiralFormerConfig
    from hf_loops.modeling.configuration_tah2 import TaH2Config

    for config_class in (TaH2Config, SGTConfig, SpiralFormerConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    known = set(ModelRegistry.get_supported_archs())
    for arch, path in MODELS.items():
        if arch not in known:
            ModelRegistry.register_model(arch, path)
