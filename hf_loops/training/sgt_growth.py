"""SGT growth: Algorithm 1 (head selection by attention entropy, progressive loop growth; docs/sgt.md).

`SGTGrowthScheduler` is the pure schedule (no model, no torch): fed per-step mean entropies, it decides, once per
optimizer step t (t starts at 1), which layer to loop, which heads to keep, when to deepen and when to freeze:

    vanilla (t < growth_start) → selecting (deep-to-shallow, deepen before widen) → fixed

`SGTGrowthCallback` wires it to a Hugging Face `Trainer`: in `on_step_end` (after the optimizer step, as the
reference) it pops the entropy sums the model accumulated over the step's micro-batches, averages them across ranks,
updates the EMA, runs the schedule, pushes gates and loop depths into the model, logs `sgt/*`, and at FIX writes the
final `loop_plan` into `model.config` so `save_pretrained` → `from_pretrained` builds the static sliced graph. Its
state travels with Trainer checkpoints (`ExportableState`; set `restore_callback_states_from_checkpoint=True`).
"""

from __future__ import annotations

import json
import math

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from ..core.flops_sgt import plan_overhead
from ..core.sgt_selection import next_layer, rank_heads, top_layers
from ..modeling.configuration_sgt import SGTConfig

logger = logging.get_logger(__name__)

VANILLA, SELECTING, FIXED = "vanilla", "selecting", "fixed"


def gate_value(step: int, start: int | None, window: int, decay: str) -> float:
    """g_h at step t for a head whose decay started at `start` (None = kept head, g = 1)."""
    if start is None:
        return 1.0
    p = (step - start) / window
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    if decay == "linear":
        return 1.0 - p
    if decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"head_decay must be 'linear' or 'cosine', got {decay!r}")


class SGTGrowthScheduler:
    """Algorithm 1 on plain Python state; `state_dict()` is JSON-serialisable."""

    def __init__(self, num_layers: int, num_heads: int, *, growth_start: int = SGTConfig.growth_start,
                 growth_window: int = SGTConfig.growth_window, growth_top_layers: int = SGTConfig.growth_top_layers,
                 growth_max_layers: int = SGTConfig.growth_max_layers, heads_per_layer: int = SGTConfig.heads_per_layer,
                 max_loop_depth: int = SGTConfig.max_loop_depth, entropy_ema: float = SGTConfig.entropy_ema,
                 growth_exclude_layers=None, head_decay: str = SGTConfig.head_decay, head_keep_schedule=None,
                 growth_direction: str = SGTConfig.growth_direction, head_selection: str = SGTConfig.head_selection):
        """Defaults are `SGTConfig`'s (one set of growth defaults); `growth_exclude_layers=None` means [0], as there."""
        if growth_exclude_layers is None:
            growth_exclude_layers = [0]
        self.num_layers, self.num_heads = num_layers, num_heads
        self.growth_start, self.growth_window = growth_start, growth_window
        self.growth_top_layers, self.growth_max_layers = growth_top_layers, growth_max_layers
        self.max_loop_depth, self.entropy_ema = max_loop_depth, entropy_ema
        self.growth_exclude_layers = list(growth_exclude_layers)
        self.head_decay = head_decay
        self.growth_direction, self.head_selection = growth_direction, head_selection
        self.head_keep_schedule = list(head_keep_schedule) if head_keep_schedule else [heads_per_layer]
        # --- mutable state ---
        self.phase = VANILLA
        self.step = 0
        self.ema = [[0.0] * num_heads for _ in range(num_layers)]  # one EMA per head (ê_{l,h}), initialised to 0
        self.selected: list[int] = []
        self.depth = [0] * num_layers
        self.kept: list[list[int]] = [[] for _ in range(num_layers)]
        self.stage = [0] * num_layers
        self.decay_start: list[list[int | None]] = [[None] * num_heads for _ in range(num_layers)]
        self.in_window = False
        self.window_end = 0
        self.history: list[dict] = []

    @classmethod
    def from_config(cls, config) -> SGTGrowthScheduler:
        return cls(config.num_hidden_layers, config.num_attention_heads, growth_start=config.growth_start,
                   growth_window=config.growth_window, growth_top_layers=config.growth_top_layers,
                   growth_max_layers=config.growth_max_layers, heads_per_layer=config.heads_per_layer,
                   max_loop_depth=config.max_loop_depth, entropy_ema=config.entropy_ema,
                   growth_exclude_layers=config.growth_exclude_layers, head_decay=config.head_decay,
                   head_keep_schedule=config.head_keep_schedule,
                   growth_direction=getattr(config, "growth_direction", "deep_to_shallow"),
                   head_selection=getattr(config, "head_selection", "highest_entropy"))

    # --- entropy -----------------------------------------------------------------------------------------------------
    def update_entropy(self, step_entropy) -> None:
        """EMA update ê_h ← β ê_h + (1 − β) e_h with this step's mean entropies `step_entropy[l][k][h]`
        (k = loop index, 0 = first pass). One EMA per head, as the reference: e_h is the last loop's entropy
        (k = K_l) for a kept head of a looped layer and the first pass's (k = 0) for every other head, so when a head
        starts looping, or its layer is deepened, the input switches and the average carries on (no restart at 0).
        None / NaN entries (not measured this step) leave ê_h unchanged."""
        if self.phase == FIXED:
            return
        b = self.entropy_ema
        for l, per_loop in enumerate(step_entropy):
            k_kept = self.depth[l]
            kept = set(self.kept[l]) if k_kept > 0 else set()
            for h in range(self.num_heads):
                k = k_kept if h in kept else 0
                e = per_loop[k][h] if k < len(per_loop) and h < len(per_loop[k]) else None
                if e is not None and not math.isnan(e):
                    self.ema[l][h] = b * self.ema[l][h] + (1.0 - b) * float(e)

    def head_entropy(self, layer: int) -> list[float]:
        """Per-head ê used for ranking (heads and layers): the per-head EMA."""
        return list(self.ema[layer])

    def layer_scores(self) -> list[float]:
        return [sum(e) / len(e) for e in (self.head_entropy(l) for l in range(self.num_layers))]

    def top_layers(self) -> list[int]:
        return top_layers(self.layer_scores(), self.growth_exclude_layers, self.growth_top_layers, self.head_selection)

    # --- gates and structure ---------------------------------------------------------------------------------------
    def gates(self, layer: int, step: int | None = None) -> list[float]:
        step = self.step if step is None else step
        return [gate_value(step, s, self.growth_window, self.head_decay) for s in self.decay_start[layer]]

    def any_decaying(self, step: int | None = None) -> bool:
        return any(0.0 < g < 1.0 for l in self.selected for g in self.gates(l, step))

    def plan(self) -> list[dict]:
        """The loop plan of the kept structure: [{"layer", "heads", "depth"}] sorted by layer."""
        return [{"layer": l, "heads": sorted(self.kept[l]), "depth": self.depth[l]} for l in sorted(self.selected)]

    # --- Algorithm 1 -------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **info) -> dict:
        event = {"step": self.step, "event": kind, **info}
        self.history.append(event)
        logger.info("SGT growth: %s", json.dumps(event))
        return event

    def _open_window(self) -> None:
        self.in_window = True
        self.window_end = self.step + self.growth_window

    def _rank_heads(self, layer: int, heads, n: int) -> list[int]:
        return rank_heads(self.head_entropy(layer), heads, n, self.head_selection)

    def _select(self, layer: int) -> dict:
        self.selected.append(layer)
        keep = self._rank_heads(layer, range(self.num_heads), self.head_keep_schedule[0])
        self.kept[layer], self.depth[layer], self.stage[layer] = keep, 1, 0
        self.decay_start[layer] = [None if h in keep else self.step for h in range(self.num_heads)]
        self._open_window()
        return self._event("select", layer=layer, heads=keep, depth=1)

    def _fix(self, reason: str) -> dict:
        self.phase = FIXED
        self.in_window = False
        return self._event("fix", reason=reason, plan=self.plan())

    def step_end(self, step: int) -> list[dict]:
        """Run Algorithm 1 for optimizer step `step` (call after `update_entropy`). Returns this step's events."""
        self.step = step
        n_events = len(self.history)
        if self.phase == FIXED or step < self.growth_start:
            return []
        if self.phase == VANILLA:  # first selection (t == growth_start when called every step)
            self.phase = SELECTING
            top = self.top_layers()
            if not top:
                self._fix("no eligible layer")
            else:
                self._select(next_layer(top, [], self.growth_direction))  # the deepest of the top layers (by default)
            return self.history[n_events:]
        if self.in_window and step < self.window_end:
            return []
        self.in_window = False
        # Optional multi-stage head selection (paper: keep 10, then 2): finish it before growing further.
        for l in self.selected:
            if self.stage[l] + 1 < len(self.head_keep_schedule):
                self.stage[l] += 1
                keep = self._rank_heads(l, self.kept[l], self.head_keep_schedule[self.stage[l]])
                for h in self.kept[l]:
                    if h not in keep:
                        self.decay_start[l][h] = step
                self.kept[l] = keep
                self._open_window()
                self._event("narrow", layer=l, heads=keep)
                return self.history[n_events:]
        top = self.top_layers()
        if not top:
            self._fix("no eligible layer in the top layers")
            return self.history[n_events:]
        for l in self.selected:  # 1) deepen before widening
            if l in top and self.depth[l] < self.max_loop_depth:
                self.depth[l] += 1
                self._open_window()
                self._event("deepen", layer=l, depth=self.depth[l])
                return self.history[n_events:]
        if len(self.selected) >= self.growth_max_layers:  # 2) budget reached
            self._fix("layer budget reached")
            return self.history[n_events:]
        layer = next_layer(top, self.selected, self.growth_direction)  # 3) deep to shallow (by default)
        if layer is None:
            side = "shallower" if self.growth_direction == "deep_to_shallow" else "deeper"
            self._fix(f"no {side} candidate in the top layers")
        else:
            self._select(layer)
        return self.history[n_events:]

    # --- state -----------------------------------------------------------------------------------------------------
    _STATE_KEYS = ("phase", "step", "ema", "selected", "depth", "kept", "stage", "decay_start", "in_window",
                   "window_end", "history")

    def state_dict(self) -> dict:
        return json.loads(json.dumps({k: getattr(self, k) for k in self._STATE_KEYS}))

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE_KEYS:
            setattr(self, k, json.loads(json.dumps(state[k])))
        if self.ema and self.ema[0] and isinstance(self.ema[0][0], list):
            # A state saved before the EMA became one per head kept one EMA per loop index, ema[l][k][h]: carry on
            # from the values ranking read then (kept heads: their last loop's, others: the first pass's).
            self.ema = [[per_loop[self.depth[l] if self.depth[l] > 0 and h in self.kept[l] else 0][h]
                         for h in range(self.num_heads)] for l, per_loop in enumerate(self.ema)]


def _sgt_base_model(model):
    """The module exposing the SGT structure API (`SGTModel`), from an `SGTForCausalLM`, a PEFT or DDP wrapper."""
    for module in model.modules():
        if hasattr(module, "set_loop") and hasattr(module, "pop_entropy_statistics"):
            return module
    raise ValueError("SGTGrowthCallback needs an SGT model (SGTForCausalLM / SGTModel)")


class SGTGrowthCallback(TrainerCallback, ExportableState):
    """Grows the SGT loop structure during `Trainer` training (Algorithm 1); see the module docstring.

    Args:
        log_entropy (`bool`, True): also log each layer's mean EMA entropy as `sgt/entropy/layer_<l>`.
        seq_len (`int`, None): training sequence length T for the logged FLOPs overhead (default: the config's
            `max_position_embeddings`).
    """

    def __init__(self, log_entropy: bool = True, seq_len: int | None = None):
        self.log_entropy = log_entropy
        self.seq_len = seq_len
        self.scheduler_state: dict | None = None  # restored by the Trainer from a checkpoint
        self.scheduler: SGTGrowthScheduler | None = None
        self.overhead_sum, self.overhead_steps, self.last_overhead = 0.0, 0, 0.0  # per-step FLOPs overheads
        self._base = None

    # --- ExportableState ---------------------------------------------------------------------------------------------
    def state(self) -> dict:
        sched = self.scheduler.state_dict() if self.scheduler is not None else self.scheduler_state
        return {"args": {"log_entropy": self.log_entropy, "seq_len": self.seq_len},
                "attributes": {"scheduler_state": sched, "overhead_sum": self.overhead_sum,
                               "overhead_steps": self.overhead_steps, "last_overhead": self.last_overhead}}

    # --- wiring ------------------------------------------------------------------------------------------------------
    def setup(self, model) -> SGTGrowthScheduler:
        """Build the scheduler from the model's config (restoring a checkpointed state if any) and push the current
        structure into the model. Called from `on_train_begin`; usable directly to drive the callback by hand."""
        self._base = _sgt_base_model(model)
        config = self._base.config
        if config.loop_mode != "heads":
            raise ValueError("SGTGrowthCallback needs loop_mode='heads' (the Block Loop baseline is static)")
        if self.scheduler is not None and self.scheduler_state is None:  # a second train() call: keep growing
            self._apply()
            return self.scheduler
        self.scheduler = SGTGrowthScheduler.from_config(config)
        if self.scheduler_state is not None:
            self.scheduler.load_state_dict(self.scheduler_state)
        elif config.loop_plan:
            logger.warning("SGTGrowthCallback: the model already has a loop_plan; nothing to grow (phase fixed).")
            s = self.scheduler
            s.phase = FIXED
            for e in config.loop_plan:
                s.selected.append(e["layer"])
                s.kept[e["layer"]], s.depth[e["layer"]] = list(e["heads"]), e["depth"]
        self._apply()
        return self.scheduler

    def _apply(self) -> None:
        s, base = self.scheduler, self._base
        for layer in base.loop_structure():  # loops the schedule does not know about (e.g. a stale plan) go
            if layer["layer"] not in s.selected:
                base.set_loop(layer["layer"], [], 0)
        for l in s.selected:
            gates = s.gates(l)
            base.set_loop(l, [h for h in range(s.num_heads) if gates[h] > 0], s.depth[l], gates)
        base.set_entropy_statistics(s.phase != FIXED)

    def current_overhead(self, seq_len: int) -> float:
        """Forward/training FLOPs overhead of the structure the model runs now (decaying heads included)."""
        return plan_overhead(self._base.config, seq_len, plan=self._base.loop_structure())

    def step_end(self, step: int, model=None) -> list[dict]:
        """One optimizer step of Algorithm 1 against the model (what `on_step_end` does)."""
        if self.scheduler is None:
            self.setup(model)
        s, base = self.scheduler, self._base
        if s.phase != FIXED:
            sums, counts = base.pop_entropy_statistics(s.max_loop_depth)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # Average over ranks: sum the per-rank sums and micro-batch counts.
                torch.distributed.all_reduce(sums)
                torch.distributed.all_reduce(counts)
            mean = torch.where(counts > 0, sums / counts.clamp_min(1), torch.full_like(sums, float("nan")))
            s.update_entropy(mean.tolist())
        events = s.step_end(step)
        self._apply()
        if any(e["event"] in ("select", "deepen", "narrow", "fix") for e in events):
            # The kept structure so far; at FIX the final static plan (gates all 0/1 then).
            base.config.loop_plan = s.plan()
            if s.phase == FIXED:
                for e in s.plan():
                    base.set_loop(e["layer"], e["heads"], e["depth"])
        self.scheduler_state = None
        return events

    def metrics(self) -> dict:
        s = self.scheduler
        out = {"sgt/phase": s.phase, "sgt/selected_layers": json.dumps(s.selected),
               "sgt/loop_depths": json.dumps({str(l): s.depth[l] for l in s.selected}),
               "sgt/num_looped_layers": len(s.selected)}
        if self.overhead_steps:
            out["sgt/flops_overhead"] = self.last_overhead  # this step's structure vs vanilla (fwd = training)
            out["sgt/flops_overhead_run"] = self.overhead_sum / self.overhead_steps  # the run so far vs vanilla
        if self.log_entropy:
            for l, score in enumerate(s.layer_scores()):
                out[f"sgt/entropy/layer_{l}"] = score
        return out

    # --- TrainerCallback ---------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.setup(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        events = self.step_end(state.global_step, model)
        self.last_overhead = self.current_overhead(self.seq_len or self._base.config.max_position_embeddings)
        self.overhead_sum += self.last_overhead
        self.overhead_steps += 1
        if events:
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.scheduler is None or logs is None:
            return
        extra = self.metrics()
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


__all__ = ["SGTGrowthCallback", "SGTGrowthScheduler", "gate_value"]
