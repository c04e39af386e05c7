"""Serving TaH2 in inference engines (vLLM plugin: `vllm_plugin`, `vllm_tah2`)."""
