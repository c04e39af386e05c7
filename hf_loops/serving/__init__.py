"""Serving: `hf-loops serve` (an OpenAI-compatible HTTP server through transformers' own `transformers serve`, `http`)
and the vLLM plugin for TaH2 and SGT (`vllm_plugin` registers `vllm_tah2` and `vllm_sgt`, `vllm_stats` returns
per-request depth statistics; they import vLLM only inside its environment)."""
