"""Qwen3 → SGT with a loop plan calibrated on text (docs/sgt.md).

SGT normally grows its loop plan during training (Algorithm 1). A conversion can instead pick the plan up front
from the source model's attention entropies on calibration text:

1. run the converted model (empty plan = exactly the source) over the calibration text with the SGT entropy probe on
   (`SGTModel.set_entropy_statistics`, the same statistic the growth callback uses: normalised entropy of the
   last valid query row per sequence, or sampled rows with `entropy_estimator="sampled_rows"`);
2. per layer, mean entropy over sequences → per-head ê_h; layer score = mean over heads;
3. Algorithm 1 with these (constant) entropies, through the scheduler's own selection rules
   (`hf_loops.core.sgt_selection`, one tie rule: the lower layer first): Top = the `growth_top_layers`
   highest-scoring layers outside `growth_exclude_layers`; SELECT the deepest of Top, then keep selecting the deepest
   remaining Top layer that is not deeper than every selected one (deep-to-shallow), until `growth_max_layers` are
   selected. With constant entropies "deepen before widening" takes every selected layer to `max_loop_depth`;
4. kept heads of a selected layer = its `heads_per_layer` highest-entropy heads. With a multi-stage
   `head_keep_schedule` (the paper's [10, 2]) the first stage keeps the top `schedule[0]` heads; each later stage
   loops the current heads, measures again (kept heads ranked by their last loop's entropy, as the scheduler does)
   and keeps the top `schedule[s]` of them.

The plan is written into `config.loop_plan` (list form, ascending layer) and applied to the model.

Block Loop (`loop_mode="block"`): the same measurement (first pass, no loops) and the same layer selection give
`config.block_loop_layers` — "the layers SGT picks" (the Block Loop baseline) — repeated `block_loop_depth` extra times.
"""

from __future__ import annotations

import os

import torch

from ..core.readers import read_text
from ..core.sgt_selection import next_layer, rank_heads, top_layers

CALIBRATION_SEQ_LEN = 256
CALIBRATION_MAX_SEQUENCES = 64


def calibration_ids(calibration, tokenizer, seq_len: int = CALIBRATION_SEQ_LEN,
                    max_sequences: int = CALIBRATION_MAX_SEQUENCES) -> list[torch.Tensor]:
    """Token sequences (1, ≤ seq_len) cut from the calibration text (a file path, a string or a list of strings)."""
    if isinstance(calibration, (str, os.PathLike)):  # a directory, a missing file or bad bytes: named as such
        texts = [read_text(calibration, "--calibration file")]
    else:
        texts = list(calibration)
    if tokenizer is None:
        raise ValueError("SGT calibration needs a tokenizer: the source has none; pass tokenizer=...")
    ids: list[int] = []
    for text in texts:
        ids += list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < 2:
        raise ValueError("the calibration text is empty (fewer than 2 tokens after tokenization)")
    seqs = [torch.tensor([ids[i : i + seq_len]]) for i in range(0, len(ids), seq_len)]
    seqs = [s for s in seqs if s.shape[1] >= 2][:max_sequences]
    return seqs


@torch.no_grad()
def measure_loop_entropy(model, sequences: list[torch.Tensor], num_loops: int = 0) -> torch.Tensor:
    """(L, num_loops + 1, H) mean normalised attention entropy of every head on `sequences`, per pass (0 = first
    pass; loop k only for the heads the current plan loops at least k times, 0 elsewhere)."""
    base = model.model
    was_training = model.training
    device = base.embed_tokens.weight.device
    try:
        model.train()  # the probe runs in training mode only; Qwen3's attention dropout is 0 by default
        base.set_entropy_statistics(True)
        sums = counts = None
        for seq in sequences:
            model(input_ids=seq.to(device), use_cache=False)
            s, c = base.pop_entropy_statistics(num_loops)
            sums = s if sums is None else sums + s
            counts = c if counts is None else counts + c
    finally:
        base.set_entropy_statistics(False)
        model.train(was_training)
    return (sums / counts.clamp_min(1)).cpu()


def measure_head_entropy(model, sequences: list[torch.Tensor]) -> torch.Tensor:
    """(L, H) mean normalised attention entropy of every head on `sequences` (first pass, no loops)."""
    return measure_loop_entropy(model, sequences, 0)[:, 0]


def effective_entropy(per_loop: torch.Tensor, plan: list[dict]) -> torch.Tensor:
    """(L, H) entropies the selection ranks by: a looped layer's looped heads use their last loop's entropy, every
    other head its first pass's (the growth scheduler's `head_entropy`)."""
    out = per_loop[:, 0].clone()
    for entry in plan:
        if entry["depth"] > 0:
            out[entry["layer"], entry["heads"]] = per_loop[entry["layer"], entry["depth"], entry["heads"]]
    return out


def select_layers(entropy: torch.Tensor, config) -> list[int]:
    """The layers Algorithm 1 loops with constant per-head entropies `entropy` (L, H), ascending: the growth
    scheduler's selection rules and tie rule (`hf_loops.core.sgt_selection`)."""
    direction = getattr(config, "growth_direction", "deep_to_shallow")
    selection = getattr(config, "head_selection", "highest_entropy")
    scores = entropy.mean(-1).tolist()
    top = top_layers(scores, config.growth_exclude_layers or [], config.growth_top_layers, selection)
    selected: list[int] = []
    while len(selected) < config.growth_max_layers:
        layer = next_layer(top, selected, direction)
        if layer is None:
            break
        selected.append(layer)
    return sorted(selected)


def plan_from_entropy(entropy: torch.Tensor, config) -> list[dict]:
    """The static plan Algorithm 1 reaches with constant per-head entropies `entropy` (L, H): the same selection
    rules (and tie rule) as the growth scheduler, `hf_loops.core.sgt_selection`; single-stage head selection
    (`heads_per_layer` heads)."""
    selection = getattr(config, "head_selection", "highest_entropy")
    return [{"layer": layer, "heads": rank_heads(entropy[layer].tolist(), range(entropy.shape[1]),
                                                 config.heads_per_layer, selection),
             "depth": config.max_loop_depth} for layer in select_layers(entropy, config)]


def calibration_plan(config, measure) -> dict:
    """The structure calibration chooses, given `measure(plan)` → (L, H) effective per-head entropies with `plan`
    looped (`[]` = the first pass of the unlooped model).

    Returns `{"block_loop_layers": [...], "block_loop_depth": K}` for `loop_mode="block"`, else
    `{"loop_plan": [...]}`, the plan after every stage of `head_keep_schedule` (one measurement per stage)."""
    entropy = measure([])
    layers = select_layers(entropy, config)
    if config.loop_mode == "block":
        return {"block_loop_layers": layers, "block_loop_depth": config.block_loop_depth}
    selection = getattr(config, "head_selection", "highest_entropy")
    schedule = list(getattr(config, "head_keep_schedule", None) or [config.heads_per_layer])
    heads = range(entropy.shape[1])
    kept = {layer: rank_heads(entropy[layer].tolist(), heads, schedule[0], selection) for layer in layers}
    for keep in schedule[1:]:  # later stages re-rank the looping heads by their own (last-loop) entropy
        plan = [{"layer": layer, "heads": kept[layer], "depth": config.max_loop_depth} for layer in layers]
        entropy = measure(plan)
        kept = {layer: rank_heads(entropy[layer].tolist(), kept[layer], keep, selection) for layer in layers}
    return {"loop_plan": [{"layer": layer, "heads": kept[layer], "depth": config.max_loop_depth}
                          for layer in layers]}


def calibrate_sgt(model, calibration, tokenizer) -> list[dict]:
    """Measure entropies on `calibration` and apply the structure they choose: the head-loop plan
    (`config.loop_plan`, returned) or, with `loop_mode="block"`, the Block Loop layers (`config.block_loop_layers`;
    returned as `[{"layer", "depth"}]`). `config.calibration_entropy` keeps the first-pass entropies."""
    config = model.config
    block = config.loop_mode == "block"
    if any(layer.loop_depth for layer in model.model.layers) or (block and config.block_loop_layers):
        raise ValueError("SGT calibration starts from an empty loop_plan / block_loop_layers; do not pass them "
                         "together with calibration")
    sequences = calibration_ids(calibration, tokenizer)
    first: list[torch.Tensor] = []

    def measure(plan):
        mode = config.loop_mode
        config.loop_mode = "heads"  # the probe runs on the head-loop path; unlooped, both paths are plain Qwen3
        try:
            for entry in plan:
                model.model.set_loop(entry["layer"], entry["heads"], entry["depth"])
            depth = max((entry["depth"] for entry in plan), default=0)
            entropy = effective_entropy(measure_loop_entropy(model, sequences, depth), plan)
            for entry in plan:
                model.model.set_loop(entry["layer"], [], 0)
        finally:
            config.loop_mode = mode
        if not first:  # the unlooped model's entropies, kept in the config
            first.append(entropy)
        return entropy

    if block:
        config.block_loop_layers = calibration_plan(config, measure)["block_loop_layers"]
        plan = [{"layer": layer, "depth": config.block_loop_depth} for layer in config.block_loop_layers]
    else:
        plan = calibration_plan(config, measure)["loop_plan"]
        for entry in plan:
            model.model.set_loop(entry["layer"], entry["heads"], entry["depth"])
        config.loop_plan = plan
    config.calibration_entropy = [[round(float(x), 6) for x in row] for row in first[0]]
    return plan


@torch.no_grad()
def sgt_one_loop_logits(model, ids: torch.Tensor, source_num_layers: int):
    """SGT with every loop depth (and Block Loop repeat) temporarily 0: the source's logits (1-loop parity)."""
    layers = model.model.layers
    saved = [(layer.loop_depth, list(layer._gate_list)) for layer in layers]
    try:
        for layer in layers:
            if layer.loop_depth:
                layer.set_loop(layer.loop_heads, 0, layer._gate_list)
        block = model.config.block_loop_layers
        model.config.block_loop_layers = []
        try:
            return model(ids, use_cache=False).logits, None
        finally:
            model.config.block_loop_layers = block
    finally:
        for layer, (depth, gates) in zip(layers, saved, strict=True):
            if depth:
                layer.set_loop([h for h, g in enumerate(gates) if g > 0], depth, gates)
