"""Per-request depth statistics of TaH2 served by vLLM, returned with each finished request.

vLLM 0.32's request output has no field a model can fill, except `kv_transfer_params`: the dict a KV connector's
scheduler side returns when a request finishes (`RequestOutput.kv_transfer_params` in `LLM.generate`, the
`kv_transfer_params` field of the OpenAI server's non-streamed chat and completion responses). `DepthStatsConnector`
is such a connector that transfers no KV at all: the model counts, per request id, the tokens it ran at each depth,
and the connector hands the counts over when the request finishes. Enable it with

    LLM(model=DIR, kv_transfer_config={"kv_connector": "DepthStatsConnector", "kv_role": "kv_both",
                                       "kv_connector_module_path": "hf_loops.serving.vllm_stats"})

(the server: `--kv-transfer-config` with the same JSON). The counts live in this module, shared by the scheduler and
the model: that needs them in one process, which is vLLM's layout at tensor/pipeline parallel size 1 (the only one
the plugin serves); the streamed responses carry no `kv_transfer_params` (vLLM's stream chunks have no such field).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

CONNECTOR = "DepthStatsConnector"
# request id → tokens run per (part, depth); part 0: prompt tokens, part 1: generated tokens fed back
_COUNTS: dict[str, torch.Tensor] = {}
_LOCK = threading.Lock()


def enabled(vllm_config) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return kv is not None and kv.kv_connector == CONNECTOR


def current_runner():
    """The model runner whose step is running (found on the call stack: vLLM hands the model no handle on it)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, GPUModelRunner):
            return owner
        frame = frame.f_back
    raise RuntimeError("TaH2 in vLLM: depth statistics need the model runner on the call stack; none was found")


def record(runner, meta, positions: torch.Tensor, depth: torch.Tensor, M: int) -> None:
    """Add this step's executed depths (real tokens only) to each request's counts."""
    num_reqs = meta.query_start_loc.shape[0] - 1
    real = meta.num_actual_tokens
    req_ids = runner.input_batch.req_ids[:num_reqs]
    tokens = torch.arange(real, device=depth.device)
    req = torch.searchsorted(meta.query_start_loc[1:].to(depth.device), tokens, right=True)
    prompt_len = torch.as_tensor(runner.input_batch.num_prompt_tokens[:num_reqs], device=depth.device)
    part = (positions[:real] >= prompt_len[req]).long()
    counts = torch.zeros(num_reqs, 2, M, dtype=torch.long)
    counts.index_put_((req.cpu(), part.cpu(), (depth[:real] - 1).cpu()), torch.ones(real, dtype=torch.long),
                      accumulate=True)
    with _LOCK:
        for i, rid in enumerate(req_ids):
            _COUNTS[rid] = _COUNTS[rid] + counts[i] if rid in _COUNTS else counts[i]


def summary(counts: torch.Tensor) -> dict:
    """tokens run at depth ≥ m+1 per m, their mean executed depth, and the continue rate after each depth."""
    per_depth = counts.flip(-1).cumsum(-1).flip(-1).tolist()  # tokens that reached depth m+1
    out = {}
    for name, row in zip(("prompt", "output"), per_depth, strict=True):
        out[name] = {"tokens_per_depth": row, "mean_depth": sum(row) / row[0] if row[0] else 0.0,
                     "continue_rate": [b / a if a else 0.0 for a, b in zip(row, row[1:], strict=False)]}
    return out


def pop(request_id: str) -> dict | None:
    with _LOCK:
        counts = _COUNTS.pop(request_id, None)
    return None if counts is None else summary(counts)


def _make_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class DepthStatsConnector(KVConnectorBase_V1):
        """A KV connector that moves no KV: it returns the request's depth statistics when the request finishes."""

        # worker side: nothing to load or save
        def start_load_kv(self, forward_context, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
            return None

        def wait_for_save(self):
            return None

        # scheduler side: no external cache hits; the statistics at the end
        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            return None

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            stats = pop(request.request_id)
            return False, None if stats is None else {"depth_statistics": stats}

    return DepthStatsConnector


def __getattr__(name):  # vLLM imports the connector class by name from this module, only once it is installed
    if name == CONNECTOR:
        cls = _make_connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
