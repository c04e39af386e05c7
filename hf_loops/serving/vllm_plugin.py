"""vLLM general plugin (entry point group `vllm.general_plugins`): registers TaH2 and SGT with vLLM's model registry.

vLLM calls `register()` in every process it starts, so it must be idempotent and cheap; the model class is given by
its import path (vLLM imports it lazily) and the configuration class is registered with `AutoConfig` (importing
`hf_loops` does that) so vLLM can read a TaH2 export's `config.json`. In the OpenAI server's own process it also
makes streamed chat and completion responses carry the per-request depth statistics
(`vllm_stats.install_stream_statistics`).
"""

from __future__ import annotations

import sys

MODELS = {
    "TaH2ForCausalLM": "hf_loops.serving.vllm_tah2:TaH2ForCausalLMvLLM",
    "SGTForCausalLM": "hf_loops.serving.vllm_sgt:SGTForCausalLMvLLM",
    # recognised, refused in one line (what to use instead)
    "SpiralFormerForCausalLM": "hf_loops.serving.vllm_tah2:SpiralFormerNotServed",
}
# imported by both server entry points (`python -m vllm.entrypoints.openai.api_server`, `vllm serve`) before vLLM
# loads the plugins, and not by the engine's processes or by `vllm.LLM`
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


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

    if SERVER_MODULE in sys.modules:  # the OpenAI server's front-end process (not the engine's, nor `LLM`'s)
        from hf_loops.serving import vllm_stats

        try:
            vllm_stats.install_stream_statistics()
        except RuntimeError as error:  # an unknown vLLM: serve on, with the statistics in non-streamed responses only
            vllm_stats.logger.warning("%s", error)

