"""Depth as the unit of scheduling for TaH2 in vLLM: a decode token whose decider continues runs its next depth in
the *next* engine step, inside that step's one weight pass with the other requests' depth-1 tokens and new
prefills, and its token is emitted only when its last depth is done (a step that emits nothing for a request).

What is relied upon in vLLM 0.32 (sync scheduling, one worker in the engine core's process):

* Worker side (the model, `vllm_tah2`): a request whose row the runner's `discard_request_mask` marks gets no
  sampled token from the step (vLLM's own handling of partial prefills: the runner clears the row's sample and
  rolls back a seeded generator). The model sets the row it defers and records the request here (`defer`).
* Scheduler side (`DepthScheduler`, a `Scheduler` subclass, vLLM's `scheduler_cls`): in `update_from_output` every
  deferred request's `num_computed_tokens` goes back by one (as vLLM rolls back rejected draft tokens), so the next
  step schedules the same token at the same position again; the model finds it in `pending` and runs its next
  depth. Preempting or freeing a request drops its pending state: a recomputed request starts the token afresh.
* The engine core builds the executor (the model) before the scheduler (`EngineCore.__init__`): the TaH2 model
  sets `scheduler_cls` to `DepthScheduler` when the engine would use vLLM's default synchronous scheduler
  (`use_depth_scheduler`), and defers only when a `DepthScheduler` was built in its own process after it
  (`schedulers_built`).
  Otherwise (another scheduler class, async scheduling, a worker in another process) every depth of a token runs
  within its step, as for prefill chunks: correct, one extra weight pass per depth.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["DepthScheduler", "PendingToken", "defer", "defer_pays", "depth_scheduling_mode", "pending",
           "schedulers_built", "use_depth_scheduler"]

_LOCK = threading.Lock()
_BUILT = [0]  # DepthSchedulers built in this process so far
_DEFERRED: set[str] = set()  # requests the model deferred in the step now being run (the scheduler rewinds them)


@dataclass
class PendingToken:
    """A decode token between two depths: its position, the depth it executed, the input of its next depth, and its
    stopping-weighted mixture so far (remaining mass R and the accumulated log ω·q over the vocabulary)."""

    position: int
    depth: int
    next_input: torch.Tensor
    remaining: torch.Tensor
    log_dist: torch.Tensor


# request id → its token in flight (written by the model, dropped by the scheduler on preemption / free)
pending: dict[str, PendingToken] = {}


def schedulers_built() -> int:
    """How many `DepthScheduler`s this process has built: a model defers once one was built after it."""
    return _BUILT[0]


def defer(request_id: str, token: PendingToken) -> None:
    with _LOCK:
        pending[request_id] = token
        _DEFERRED.add(request_id)


def _drop(request_id: str) -> None:
    with _LOCK:
        pending.pop(request_id, None)
        _DEFERRED.discard(request_id)


# "1" (default): a continuing decode token's next depth goes to the next step when that saves a weight pass (see
# `defer_pays`); "always": whenever it continues; "0": every depth of a token runs within its step
ENV = "HF_LOOPS_VLLM_DEPTH_SCHEDULING"
MODES = ("0", "1", "always")


def depth_scheduling_mode() -> str:
    """The setting of `HF_LOOPS_VLLM_DEPTH_SCHEDULING` ('1' when unset), checked."""
    value = os.environ.get(ENV, "1")
    if value not in MODES:
        raise ValueError(f"TaH2 in vLLM: {ENV} must be '0', '1' or 'always', got {value!r}")
    return value


def defer_pays(stopped: bool, inline: bool) -> bool:
    """Whether handing a pass's continuing decode tokens to the next step saves a weight pass (mode '1'): only when
    some token of the pass stops (its request brings a fresh token to the next step's pass, which the deferred
    depths share) and no token that cannot be deferred (a prefill chunk's) continues (else a further pass of this
    step runs anyway and carries them too). When every token of a pass continues (one request, or a fixed-depth
    model), deferring would only add an engine step per depth: they run their next depth within the step."""
    return stopped and not inline


def use_depth_scheduler(vllm_config) -> bool:
    """Make the engine build a `DepthScheduler` where it would build vLLM's default synchronous one (unless
    `HF_LOOPS_VLLM_DEPTH_SCHEDULING=0`); True if the engine's scheduler is (or now will be) a `DepthScheduler`."""
    value = depth_scheduling_mode()
    sched = vllm_config.scheduler_config
    if value == "0" or sched.async_scheduling:
        return False
    if sched.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler", Scheduler):
        sched.scheduler_cls = DepthScheduler
        return True
    cls = sched.scheduler_cls
    return isinstance(cls, type) and issubclass(cls, DepthScheduler) or cls == f"{__name__}.DepthScheduler"


class DepthScheduler(Scheduler):
    """vLLM's scheduler, plus: a request the model deferred in a step (its token continues to a deeper depth) gets
    its last token scheduled again in the next step (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with _LOCK:
            _BUILT[0] += 1

    def update_from_output(self, scheduler_output, model_runner_output):
        with _LOCK:
            deferred = set(_DEFERRED)
            _DEFERRED.clear()
        for req_id in deferred:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                _drop(req_id)
                continue
            index = model_runner_output.req_id_to_index.get(req_id)
            sampled = model_runner_output.sampled_token_ids
            if index is not None and sampled and sampled[index]:
                raise RuntimeError(f"TaH2 in vLLM: request {req_id} was deferred but the runner sampled a token "
                                   "for it (vLLM's discard_request_mask no longer works as vLLM 0.32's)")
            request.num_computed_tokens -= 1  # the same token at the same position again, at its next depth
        return super().update_from_output(scheduler_output, model_runner_output)

    def _preempt_request(self, request, *args, **kwargs):
        _drop(request.request_id)
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        _drop(request.request_id)
        return super()._free_request(request, *args, **kwargs)
