"""Per-request depth statistics of TaH2 served by vLLM, returned with each finished request.

vLLM 0.32's request output has no field a model can fill, except `kv_transfer_params`: the dict a KV connector's
scheduler side returns when a request finishes (`RequestOutput.kv_transfer_params` in `LLM.generate`, the
`kv_transfer_params` field of the OpenAI server's non-streamed chat and completion responses). `DepthStatsConnector`
is such a connector that transfers no KV at all. Enable it with

    LLM(model=DIR, kv_transfer_config={"kv_connector": "DepthStatsConnector", "kv_role": "kv_both",
                                       "kv_connector_module_path": "hf_loops.serving.vllm_stats"})

(the server: `--kv-transfer-config` with the same JSON).

How the counts travel: the model (worker process) counts, per request id, the tokens it ran at each depth in this
step; the connector's worker side hands them over as its per-step worker metadata (vLLM's worker → scheduler
channel, `build_connector_worker_meta`), and its scheduler side adds them up per request (`update_connector_output`)
and returns them when the request finishes. So the worker and the scheduler may live in different processes (the
OpenAI server's default layout: front end, engine core, worker). vLLM calls `request_finished` before it reads the
step's worker metadata, so the dict returned there is completed in place with the request's last step when that
metadata arrives, within the same scheduler update (before the outputs leave the engine core).

Sampling n > 1: vLLM runs each choice as a child request `"{index}_{parent id}"`, and when several children's outputs
reach the server together it keeps the `kv_transfer_params` of one of them. So a child's dict carries the statistics
of every sibling finished so far (`depth_statistics_per_choice`, by choice index) and `depth_statistics` is their sum:
the last child to finish carries the whole request.

Streamed responses: vLLM's stream generators drop `kv_transfer_params`. `install_stream_statistics` (called by the
plugin in the OpenAI server's process) wraps the chat and completion stream generators of vLLM 0.32 so that the last
chunk before `[DONE]` carries `depth_statistics`, one entry per choice (see `docs/serving.md`).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from typing import Any

import torch

CONNECTOR = "DepthStatsConnector"
# Counts are (2, M) tensors: tokens run per (part, executed depth); part 0: prompt tokens, part 1: generated tokens
# fed back. Worker side: this step's counts per request id, until the connector's worker side takes them.
_STEP: dict[str, torch.Tensor] = {}
# Scheduler side: each running request's counts so far; the finished requests of this scheduler update, waiting for
# the step's last counts; n > 1: parent request id → its finished children's counts by choice index (the most recent
# parents only: vLLM does not tell the connector how many children a parent has, so groups are dropped oldest first)
_COUNTS: dict[str, torch.Tensor] = {}
_FINISHED: dict[str, tuple[torch.Tensor, dict]] = {}
_CHOICES: OrderedDict[str, dict[int, torch.Tensor]] = OrderedDict()
MAX_PARENTS = 4096
_LOCK = threading.Lock()
# vLLM 0.32's child request id for choice `index` of a parent request (`ParentRequest.get_child_info`); a request
# whose own id has this shape with n = 1 is taken for a one-child group, which changes nothing but the index it lists
_CHILD_ID = re.compile(r"(\d+)_(.+)")


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
    """Worker side: add this step's executed depths (real tokens only) to each request's counts of the step; a token
    of depth 0 is not counted (a decode token whose depths go on in the next step: it counts when it finishes)."""
    num_reqs = meta.query_start_loc.shape[0] - 1
    real = meta.num_actual_tokens
    req_ids = runner.input_batch.req_ids[:num_reqs]
    tokens = (depth[:real] > 0).nonzero().squeeze(1)
    req = torch.searchsorted(meta.query_start_loc[1:].to(depth.device), tokens, right=True)
    prompt_len = torch.as_tensor(runner.input_batch.num_prompt_tokens[:num_reqs], device=depth.device)
    part = (positions[tokens] >= prompt_len[req]).long()
    counts = torch.zeros(num_reqs, 2, M, dtype=torch.long)
    counts.index_put_((req.cpu(), part.cpu(), (depth[tokens] - 1).cpu()), torch.ones(tokens.numel(), dtype=torch.long),
                      accumulate=True)
    with _LOCK:
        for i, rid in enumerate(req_ids):
            _STEP[rid] = _STEP[rid] + counts[i] if rid in _STEP else counts[i]


def take_step_counts() -> dict[str, torch.Tensor]:
    """Worker side: this step's counts, handed over once."""
    with _LOCK:
        step = dict(_STEP)
        _STEP.clear()
    return step


def add_step_counts(step: dict[str, torch.Tensor]) -> None:
    """Scheduler side: one step's counts from the worker. Requests that finished in this scheduler update get their
    last counts here, and the dicts already returned for them are completed in place."""
    with _LOCK:
        for rid, counts in step.items():
            if rid in _FINISHED:
                _FINISHED[rid][0].add_(counts)  # the request's own tensor, also held by its sibling group
            else:
                _COUNTS[rid] = _COUNTS[rid] + counts if rid in _COUNTS else counts.clone()
        finished = list(_FINISHED.items())
        _FINISHED.clear()
    for rid, (counts, params) in finished:
        params.clear()
        params.update(_params(rid, counts))


def summary(counts: torch.Tensor) -> dict:
    """tokens run at depth ≥ m+1 per m, their mean executed depth, and the continue rate after each depth."""
    per_depth = counts.flip(-1).cumsum(-1).flip(-1).tolist()  # tokens that reached depth m+1
    out = {}
    for name, row in zip(("prompt", "output"), per_depth, strict=True):
        out[name] = {"tokens_per_depth": row, "mean_depth": sum(row) / row[0] if row[0] else 0.0,
                     "continue_rate": [b / a if a else 0.0 for a, b in zip(row, row[1:], strict=False)]}
    return out


def _params(request_id: str, counts: torch.Tensor) -> dict:
    """The `kv_transfer_params` of a finished request: its `depth_statistics`; for a child of an n > 1 request, also
    `depth_statistics_per_choice` of every sibling finished so far, and `depth_statistics` is their sum."""
    child = _CHILD_ID.fullmatch(request_id)
    if child is None:
        return {"depth_statistics": summary(counts)}
    with _LOCK:
        siblings = dict(_CHOICES.get(child[2], {}))
    return {"depth_statistics": summary(sum(siblings.values())),
            "depth_statistics_per_choice": [{"index": i, **summary(c)} for i, c in sorted(siblings.items())]}


def finish(request_id: str, M: int) -> dict:
    """Scheduler side: the statistics of a request that just finished, completed in place by `add_step_counts` with
    the step that finished it (a request that never ran a token gets zero counts)."""
    with _LOCK:
        counts = _COUNTS.pop(request_id, None)
        if counts is None:  # its only step is the one that finished it: the counts are still to come
            counts = torch.zeros(2, M, dtype=torch.long)
        child = _CHILD_ID.fullmatch(request_id)
        if child is not None:
            siblings = _CHOICES.setdefault(child[2], {})
            siblings[int(child[1])] = counts
            _CHOICES.move_to_end(child[2])
            while len(_CHOICES) > MAX_PARENTS:
                _CHOICES.popitem(last=False)
        params: dict = {}
        _FINISHED[request_id] = (counts, params)
    params.update(_params(request_id, counts))
    return params


# ----------------------------------------------------------------------------------------------------------------------
# Streamed responses: the OpenAI server's stream generators drop kv_transfer_params; a narrow wrapper adds them back
# ----------------------------------------------------------------------------------------------------------------------

STREAM_FIELD = "depth_statistics"
# the vLLM versions whose stream generators the wrapper was written against (read, and tested, on 0.32.0)
KNOWN_VLLM = ("0.32.",)
_DONE = "data: [DONE]\n\n"
logger = logging.getLogger(__name__)


def _choice_statistics(params: dict | None, prompt_index: int, n: int) -> dict[int, dict]:
    """Choice index → {prompt, output} statistics found in one output's kv_transfer_params (a completion request
    with several prompts numbers its choices prompt by prompt, n each)."""
    if not params or "depth_statistics" not in params:
        return {}
    if n == 1:
        return {prompt_index: params["depth_statistics"]}
    return {prompt_index * n + entry["index"]: {k: v for k, v in entry.items() if k != "index"}
            for entry in params.get("depth_statistics_per_choice", [])}


def _wrap_stream(original, per_prompt: bool):
    """Wrap a stream generator: tap the engine outputs it reads (their kv_transfer_params, which it drops), and add
    the collected statistics, one entry per choice, to the last chunk before `[DONE]`: the usage chunk when the
    request asked for one (`stream_options.include_usage`), else a chunk of its own with no choices."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def stream(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        n = bound.arguments["request"].n or 1
        found: dict[int, dict] = {}
        state = {"source_done": False, "first": None}

        async def tap(source):
            async for item in source:
                prompt_index, output = item if per_prompt else (0, item)
                found.update(_choice_statistics(output.kv_transfer_params, prompt_index, n))
                yield item
            state["source_done"] = True

        bound.arguments["result_generator"] = tap(bound.arguments["result_generator"])
        async for chunk in original(*bound.args, **bound.kwargs):
            if state["first"] is None and chunk.startswith("data: {"):
                state["first"] = chunk
            if found and state["source_done"]:  # every output read: what follows is the usage chunk or [DONE]
                entries = json.dumps([{"index": i, **found[i]} for i in sorted(found)], separators=(",", ":"))
                if chunk == _DONE:
                    head = json.loads(state["first"][6:]) if state["first"] else {}
                    extra = "".join(f"{json.dumps(key)}:{json.dumps(head[key])}," for key in
                                    ("id", "object", "created", "model") if key in head)
                    yield f'data: {{{extra}"choices":[],"{STREAM_FIELD}":{entries}}}\n\n'
                    found.clear()
                elif chunk.startswith("data: {") and chunk.endswith("}\n\n"):
                    body = json.loads(chunk[6:])
                    if body.get("choices") == [] and "usage" in body:  # the final usage chunk: the field rides on it
                        chunk = f'{chunk[:-3]},"{STREAM_FIELD}":{entries}}}\n\n'
                        found.clear()
            yield chunk

    stream._hf_loops_depth_statistics = True
    return stream


def install_stream_statistics(version: str | None = None) -> bool:
    """Make the OpenAI server's streamed chat and completion responses carry per-choice depth statistics (vLLM 0.32
    only: the wrapped methods are not a public interface). Idempotent; returns True once installed. Raises a
    one-line RuntimeError on a vLLM version or a stream generator it does not know."""
    import vllm

    version = version or vllm.__version__
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    targets = ((OpenAIServingChat, "chat_completion_stream_generator", False),
               (OpenAIServingCompletion, "completion_stream_generator", True))
    known = version.startswith(KNOWN_VLLM) and all(
        {"request", "result_generator"} <= set(inspect.signature(getattr(cls, name)).parameters)
        for cls, name, _ in targets)
    if not known:
        raise RuntimeError(f"hf_loops: streamed depth statistics are written for vLLM {'/'.join(KNOWN_VLLM)}x, not "
                           f"{version}: streamed responses carry none (non-streamed ones still do)")
    for cls, name, per_prompt in targets:
        method = getattr(cls, name)
        if not getattr(method, "_hf_loops_depth_statistics", False):
            setattr(cls, name, _wrap_stream(method, per_prompt))
    return True


def _make_classes():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )

    class DepthCounts(KVConnectorWorkerMetadata):
        """One step's counts per request id, from the worker to the scheduler."""

        def __init__(self, counts: dict[str, torch.Tensor]):
            self.counts = counts

        def aggregate(self, other):  # several workers: vLLM runs TaH2 on one (tensor/pipeline parallel size 1)
            merged = dict(self.counts)
            for rid, counts in other.counts.items():
                merged[rid] = merged[rid] + counts if rid in merged else counts
            return DepthCounts(merged)

    class DepthStatsConnector(KVConnectorBase_V1):
        """A KV connector that moves no KV: it carries the model's per-request depth counts from the worker to the
        scheduler and returns them, as `kv_transfer_params`, when the request finishes."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            # TaH2 counts depths; any other model served with the connector gets no statistics
            self.max_iterations = getattr(vllm_config.model_config.hf_config, "max_iterations", None)

        # worker side: nothing to load or save; this step's counts go to the scheduler
        def start_load_kv(self, forward_context, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
            return None

        def wait_for_save(self):
            return None

        def build_connector_worker_meta(self):
            step = take_step_counts()
            return DepthCounts(step) if step else None

        # scheduler side: no external cache hits; the counts as they arrive, the statistics at the end
        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            return None

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def update_connector_output(self, connector_output):
            meta = connector_output.kv_connector_worker_meta
            if isinstance(meta, DepthCounts):
                add_step_counts(meta.counts)

        def request_finished(self, request, block_ids):
            if self.max_iterations is None:
                return False, None
            return False, finish(request.request_id, self.max_iterations)

    # importable by name: vLLM loads the connector by name, and pickles the worker metadata between processes
    DepthCounts.__qualname__ = "DepthCounts"
    DepthStatsConnector.__qualname__ = CONNECTOR
    return {"DepthCounts": DepthCounts, CONNECTOR: DepthStatsConnector}


def __getattr__(name):  # vLLM's classes are built on first use (this module imports without vLLM)
    if name in ("DepthCounts", CONNECTOR):
        globals().update(_make_classes())
        return globals()[name]
    raise AttributeError(name)
