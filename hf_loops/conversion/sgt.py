"""Qwen3 → SGT with a loop plan calibrated on text (spec: shared/specs/sgt.md §3–§5).

SGT normally grows its loop plan during training (Algorithm 1). A conversion can instead pick the plan up front
from the source model's attention entropies on calibration text:

1. run the converted model (empty plan = exactly the source) over the calibration text with the SGT entropy probe on
   (`SGTModel.set_entropy_statistics`, the same statistic the growth callback uses: normalised entropy of the
   last valid query row per sequence, or sampled rows with `entropy_estimator="sampled_rows"`);
2. per layer, mean entropy over sequences → per-head ê_h; layer score = mean over heads;
3. Algorithm 1 with these (constant) entropies, through the scheduler's own selection rules
   (`hf_loops.training.sgt_selection`, one tie rule: the deeper layer first): Top = the `growth_top_layers`
   highest-scoring layers outside `growth_exclude_layers`; SELECT the deepest of Top, then keep selecting the deepest
   remaining Top layer that is not deeper than every selected one (deep-to-shallow), until `growth_max_layers` are
   selected. With constant entropies "deepen before widening" takes every selected layer to `max_loop_depth`;
4. kept heads of a selected layer = its `heads_per_layer` highest-entropy heads.

The plan is written into `config.loop_plan` (list form, ascending layer) and applied to the model.
"""

from __future__ import annotations

import os

import torch

from ..training.sgt_selection import next_layer, rank_heads, top_layers

CALIBRATION_SEQ_LEN = 256
CALIBRATION_MAX_SEQUENCES = 64


def calibration_ids(calibration, tokenizer, seq_len: int = CALIBRATION_SEQ_LEN,
                    max_sequences: int = CALIBRATION_MAX_SEQUENCES) -> list[torch.Tensor]:
    """Token sequences (1, ≤ seq_len) cut from the calibration text (a file path, a string or a list of strings)."""
    if isinstance(calibration, (str, os.PathLike)) and os.path.isfile(calibration):
        with open(calibration, encoding="utf-8") as f:
            texts = [f.read()]
    elif isinstance(calibration, (str, os.PathLike)):
        raise ValueError(f"calibration file {os.fspath(calibration)!r} does not exist")
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
def measure_head_entropy(model, sequences: list[torch.Tensor]) -> torch.Tensor:
    """(L, H) mean normalised attention entropy of every head on `sequences` (first pass, no loops)."""
    base = model.model
    was_training = model.training
    device = base.embed_tokens.weight.device
    try:
        model.train()  # the probe runs in training mode only; Qwen3's attention dropout is 0 by default
        base.set_entropy_statistics(True)
        sums = counts = None
        for seq in sequences:
            model(input_ids=seq.to(device), use_cache=False)
            s, c = base.pop_entropy_statistics(0)
            sums = s if sums is None else sums + s
            counts = c if counts is None else counts + c
    finally:
        base.set_entropy_statistics(False)
        model.train(was_training)
    return (sums[:, 0] / counts[:, 0].clamp_min(1)).cpu()


def plan_from_entropy(entropy: torch.Tensor, config) -> list[dict]:
    """The static plan Algorithm 1 reaches with constant per-head entropies `entropy` (L, H): the same selection
    rules (and tie rule) as the growth scheduler, `hf_loops.training.sgt_selection`."""
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
    return [{"layer": layer, "heads": rank_heads(entropy[layer].tolist(), range(entropy.shape[1]),
                                                 config.heads_per_layer, selection),
             "depth": config.max_loop_depth} for layer in sorted(selected)]


def calibrate_sgt(model, calibration, tokenizer) -> list[dict]:
    """Measure entropies on `calibration`, write the plan into `model.config.loop_plan` and apply it."""
    if model.config.loop_mode != "heads":
        raise ValueError("SGT calibration needs loop_mode='heads'")
    if any(layer.loop_depth for layer in model.model.layers):
        raise ValueError("SGT calibration starts from an empty loop_plan; do not pass loop_plan together with "
                         "calibration")
    entropy = measure_head_entropy(model, calibration_ids(calibration, tokenizer))
    plan = plan_from_entropy(entropy, model.config)
    for entry in plan:
        model.model.set_loop(entry["layer"], entry["heads"], entry["depth"])
    model.config.loop_plan = plan
    model.config.calibration_entropy = [[round(float(x), 6) for x in row] for row in entropy]
    return plan
