"""Serving wings: `hf-loops serve` (an OpenAI-compatible HTTP server through transformers' own `transformers serve`)."""
