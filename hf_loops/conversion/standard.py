"""A Standard (M = 1) TaH2 model as the `Qwen3ForCausalLM` it computes: what `hf-loops train --arch standard` saves.

At `max_iterations == 1` depth 1 is the last depth, so TaH2ForCausalLM's forward is the plain Qwen3 stack — the
embeddings, the decoder layers, the final norm and the LM head under Qwen3's own state-dict names, raw logits
(`TaH2CausalLMOutput.logits`) — and three modules never run:
- `updater`: it builds the next depth's input, only for tokens that continue past depth 1 (none do);
- `decider` (learned or exit gate): `_depth_step` skips it at the last depth;
- `core_adapter` (Huginn-style): it runs between core iterations (m < M), and there is one.
The Standard preset (`decider="never"`, `updater="identity"`) has none of them; a run that sets one on the command
line (`--arch standard --updater learned`) carries it, trained by nothing but the zero-weighted anchor. They are
dropped; every other parameter must fill the Qwen3 model exactly (`qwen3_backbone`'s strict load).
"""

from __future__ import annotations

from transformers import PreTrainedModel

__all__ = ["NOT_RUN_AT_DEPTH_1", "is_one_pass", "standard_to_qwen3"]

# The TaH2ForCausalLM modules that run only between depths (never when M = 1): the parameters the Qwen3 save drops.
NOT_RUN_AT_DEPTH_1 = ("updater", "decider", "core_adapter")


def is_one_pass(model) -> bool:
    """Whether `model` is a TaH2 model whose forward is one pass of its Qwen3 backbone (max_iterations == 1)."""
    return getattr(model.config, "model_type", None) == "tah2" and model.config.max_iterations == 1


def standard_to_qwen3(model: PreTrainedModel) -> tuple[PreTrainedModel, list[str]]:
    """(the `Qwen3ForCausalLM` that `model`, a TaH2ForCausalLM with max_iterations == 1, computes; the names of the
    parameters left out). The Qwen3 model holds the same tensors (no copy) and the model's generation config; its
    config is `model.config` without the TaH2 loop fields (model_type "qwen3"). Anything other than the loop-only
    modules (`NOT_RUN_AT_DEPTH_1`) that does not fill the Qwen3 model is a `ValueError`."""
    from ..modeling.tah2_official import qwen3_backbone

    if not is_one_pass(model):
        raise ValueError(f"standard_to_qwen3 takes a TaH2 model with max_iterations == 1; got model_type "
                         f"{getattr(model.config, 'model_type', None)!r}, max_iterations "
                         f"{getattr(model.config, 'max_iterations', None)!r}")
    prefixes = tuple(f"{name}." for name in NOT_RUN_AT_DEPTH_1)
    extra = [n for n, _ in model.named_children() if n not in ("model", "lm_head", *NOT_RUN_AT_DEPTH_1)]
    if extra:
        raise ValueError(f"standard_to_qwen3: the TaH2 model has modules a Qwen3ForCausalLM lacks: {extra}")
    dropped = [k for k in model.state_dict() if k.startswith(prefixes)]
    return qwen3_backbone(model, drop=prefixes), dropped
