"""Serving: `hf-loops serve` (an OpenAI-compatible HTTP server through transformers' own `transformers serve`, `http`)
and the vLLM plugin for TaH2 (`vllm_plugin` registers `vllm_tah2`; it imports only inside vLLM's environment)."""
