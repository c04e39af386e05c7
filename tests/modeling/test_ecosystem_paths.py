"""The ecosystem's own paths on the three architectures: activation checkpointing (reentrant and not),
`return_dict=False`, the tensor/pipeline-parallel plans, cache cropping (assisted decoding, prompt lookup), and TaH2's
per-depth buffers growing only with the depth actually reached."""

from __future__ import annotations

import fnmatch
import tracemalloc

import pytest
import torch
from tah2_helpers import script_decider, tiny_qwen3, tiny_tah2
from transformers import Qwen3ForCausalLM, Qwen3Model

from hf_loops import SGTConfig, SGTForCausalLM, SpiralFormerConfig, SpiralFormerForCausalLM
from hf_loops.modeling.modeling_sgt import SGTModel
from hf_loops.modeling.modeling_spiralformer import SpiralFormerModel
from hf_loops.modeling.modeling_tah2 import TaH2ForCausalLM, TaH2Model

VOCAB = 97


def half_continue(embeds, hidden=None):
    """g = 0.9 for tokens whose first embedding coordinate is positive, else 0.1: a mixed continue pattern."""
    return torch.where(embeds[..., 0] > 0, 0.9, 0.1)


def tah2_model(M: int = 2, **overrides):
    return script_decider(tiny_tah2(max_iterations=M, decisive=False, **overrides), half_continue)


def spiral_model(M: int = 2, seed: int = 0, **overrides):
    """M loop iterations (chunk sizes 8, 4, 2 cut to M), MeSH topology, learned scalers switched on."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, num_hidden_layers=3, num_pre_layers=1, num_loop_layers=1, num_post_layers=1,
               pad_token_id=0, bos_token_id=1, eos_token_id=1, attn_implementation="eager",
               chunk_sizes=[8, 4, 2][:M], topology="mesh")
    cfg.update(overrides)
    model = SpiralFormerForCausalLM(SpiralFormerConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("scorers", "allocators", "routers")):
                p.normal_(0.0, 0.5)
    return model.eval()


def sgt_model(M: int = 2, seed: int = 0, **overrides):
    """Layer 1 loops heads 0 and 3 M times, layer 2 loops head 1 once."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
               pad_token_id=0, eos_token_id=1, bos_token_id=2,
               loop_plan=[{"layer": 1, "heads": [0, 3], "depth": M}, {"layer": 2, "heads": [1], "depth": 1}])
    cfg.update(overrides)
    return SGTForCausalLM(SGTConfig(**cfg)).eval()


BUILDERS = {"tah2": tah2_model, "spiralformer": spiral_model, "sgt": sgt_model}


# ----------------------------------------------------------------------------------------------------------------------
# Activation checkpointing, reentrant and not: the same gradients as without it (fp64)
# ----------------------------------------------------------------------------------------------------------------------


def _loss_and_grads(model, ids, checkpointing):
    model = model.double().train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-300)) for n in a)


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_checkpointing_reentrant_or_not_gives_the_gradients_without_it(arch, M):
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(20 + M))
    loss_ref, ref = _loss_and_grads(BUILDERS[arch](M), ids, None)
    assert len(ref) > 10
    for reentrant in (False, True):
        loss, grads = _loss_and_grads(BUILDERS[arch](M), ids, reentrant)
        assert torch.equal(loss, loss_ref)
        assert _worst_relative_difference(grads, ref) < 1e-6, (arch, M, reentrant)
    if arch == "tah2" and M > 1:  # the depth-1 K/V feed deeper depths: the learned loop parts are in the graph
        assert any(n.startswith("updater.") for n in ref) and any(n.startswith("decider.") for n in ref)


@pytest.mark.parametrize("overrides", [dict(iteration_attention="same_iter"), dict(iteration_attention="causal"),
                                       dict(decider="exit_gate", exit_kv_fill="copy_last", mixture="final", iteration_attention="same_iter"),
                                       dict(core_adapter="huginn", decider="always", iteration_attention="same_iter", mixture="final")],
                         ids=["same_iter", "causal", "exit_gate_copy_last", "huginn"])
def test_tah2_reentrant_checkpointing_is_exact_for_other_visibility_modes(overrides):
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    def build():
        if "decider" in overrides:  # fixed or gate deciders: nothing to script
            return tiny_tah2(max_iterations=3, decisive=False, **overrides)
        return tah2_model(3, **overrides)

    _, ref = _loss_and_grads(build(), ids, None)
    _, grads = _loss_and_grads(build(), ids, True)
    assert _worst_relative_difference(grads, ref) < 1e-6
