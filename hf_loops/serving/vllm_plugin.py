"""vLLM general plugin (entry point group `vllm.general_plugins`): registers TaH2 with vLLM's model registry.

vLLM calls `register()` in every process it starts, so it must be idempotent and cheap; the model class is given by
its import path (vLLM imports it lazily) and the configuration class is registered with `AutoConfig` (importing
`hf_loops` does that) so vLLM can read a TaH2 export's `config.json`.
"""

from __future__ import annotations

MODEL_CLASS = "hf_loops.serving.vllm_tah2:TaH2ForCausalLMvLLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from hf_loops.modeling.configuration_tah2 import TaH2Config

    AutoConfig.register(TaH2Config.model_type, TaH2Config, exist_ok=True)
    if "TaH2ForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("TaH2ForCausalLM", MODEL_CLASS)
