"""The ecosystem's own paths on the three architectures: activation checkpointing (reentrant and not),
`return_dict=False`, the tensor/pipeline-parallel plans, cache cropping (assisted decoding, prompt lookup), and TaH2's
per-depth buffers growing only with the depth actually reached."""

from __future__ import annotations

import copy
import fnmatch
import re

import pytest
import torch
from helpers.tah2_helpers import script_decider, tiny_qwen3, tiny_tah2
from transformers import Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache

from hf_loops import SGTConfig, SGTForCausalLM, SpiralFormerConfig, SpiralFormerForCausalLM
from hf_loops.core.compat import enable_activation_checkpointing
from hf_loops.modeling.modeling_sgt import SGTModel
from hf_loops.modeling.modeling_spiralformer import SpiralFormerModel
from hf_loops.modeling.modeling_tah2 import TaH2ForCausalLM, TaH2Model

VOCAB = 97


def half_continue(embeds, hidden=None):
    """g = 0.9 for tokens whose first embedding coordinate is positive, else 0.1: a mixed continue pattern."""
    return torch.where(embeds[..., 0] > 0, 0.9, 0.1)


def tah2_model(M: int = 2, seed: int = 0, **overrides):
    return script_decider(tiny_tah2(seed, max_iterations=M, decisive=False, **overrides), half_continue)


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
@pytest.mark.slow
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


def test_tah2_lora_with_reentrant_checkpointing_is_exact():
    """PEFT LoRA with reentrant checkpointing (what TRL forces for PEFT + ZeRO-3 in GRPO), through transformers'
    current entry point `activation_checkpointing_enable`."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    grads = {}
    for reentrant in (None, True):
        torch.manual_seed(0)
        model = get_peft_model(tah2_model(3).double(), LoraConfig(target_modules=["q_proj", "k_proj", "v_proj"], r=2,
                                                                  init_lora_weights=False))
        model.train()
        if reentrant is not None:
            enable_activation_checkpointing(model, {"use_reentrant": reentrant})
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads[reentrant] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads[None]) == 2 * 3 * 2  # A and B of q/k/v in both layers
    assert _worst_relative_difference(grads[True], grads[None]) < 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# return_dict=False (transformers' `can_return_tuple` convention, as Qwen3Model / Qwen3ForCausalLM)
# ----------------------------------------------------------------------------------------------------------------------


def _base_and_causal(arch):
    causal = BUILDERS[arch](2)
    base_class = {"tah2": TaH2Model, "spiralformer": SpiralFormerModel, "sgt": SGTModel}[arch]
    torch.manual_seed(0)
    return base_class(copy.deepcopy(causal.config)).eval(), causal


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_return_dict_false_gives_the_tuple_of_the_output_fields(arch):
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    for model in _base_and_causal(arch):
        with torch.no_grad():
            as_dict = model(ids, use_cache=False)
            as_tuple = model(ids, use_cache=False, return_dict=False)
        assert isinstance(as_tuple, tuple) and not hasattr(as_tuple, "keys"), type(model).__name__
        assert len(as_tuple) == len(as_dict.to_tuple())
        for a, b in zip(as_tuple, as_dict.to_tuple(), strict=False):
            if torch.is_tensor(a):
                assert torch.equal(a, b)
        first = as_dict.last_hidden_state if hasattr(as_dict, "last_hidden_state") else as_dict.logits
        assert torch.equal(as_tuple[0], first)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_config_return_dict_false_is_honoured_and_the_causal_lm_still_runs(arch):
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    for model in _base_and_causal(arch):
        with torch.no_grad():
            ref = model(ids, use_cache=False).to_tuple()[0]
        model.config.return_dict = False
        with torch.no_grad():
            out = model(ids, use_cache=False)
        assert isinstance(out, tuple) and torch.equal(out[0], ref), type(model).__name__
        with torch.no_grad():  # an explicit return_dict=True wins over the config
            assert torch.equal(model(ids, use_cache=False, return_dict=True).to_tuple()[0], ref)


# ----------------------------------------------------------------------------------------------------------------------
# Tensor- and pipeline-parallel plans: Qwen3's coverage of the backbone and the LM head; the loop's modules replicated
# ----------------------------------------------------------------------------------------------------------------------


def plan_style(plan: dict, param_name: str):
    """The plan entry that applies to a parameter, found the way transformers' `verify_tp_plan` does: layer indices
    become `*`, then the parameter's own name or its module's name is looked up."""

    generic = re.sub(r"\d+", "*", param_name)
    if generic in plan:
        return plan[generic]
    parent = generic.rsplit(".", 1)[0]
    return plan.get(parent)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_tp_plan_covers_every_parameter_qwen3s_plan_covers_and_replicates_the_loop_modules(arch):
    qwen = tiny_qwen3(0)
    model = BUILDERS[arch](2)
    q_plan, plan = qwen.tp_plan, model.tp_plan
    assert plan.get("lm_head") == q_plan["lm_head"] == "colwise_gather_output"
    q_names = dict(qwen.named_parameters())
    covered_by_qwen = {n: plan_style(q_plan, n) for n in q_names if plan_style(q_plan, n) is not None}
    assert len(covered_by_qwen) >= 9 * qwen.config.num_hidden_layers  # q/k/v/o, q/k norms, gate/up/down per layer
    ours = dict(model.named_parameters())
    shared = [n for n in covered_by_qwen if n in ours]
    assert len(shared) >= 9 * 2, "the backbone keeps Qwen3's parameter names"
    for name in shared:
        assert plan_style(plan, name) == covered_by_qwen[name], name
    # Every Qwen3-named parameter of ours that the Qwen3 plan would shard is sharded the same way; the loop's own
    # modules (updater, decider, SpiralFormer's scalers and routers, SGT's extras) are not in the plan: replicated.
    for name in ours:
        if plan_style(q_plan, name) is not None:
            assert plan_style(plan, name) == plan_style(q_plan, name), name
        elif not name.startswith(("model.embed_tokens", "lm_head")):
            assert plan_style(plan, name) is None, name
    assert type(model)._tp_plan == Qwen3ForCausalLM._tp_plan and type(model)._pp_plan == Qwen3ForCausalLM._pp_plan
    assert model.pp_plan.keys() == qwen.pp_plan.keys()
    assert model.model.tp_plan == qwen.model.tp_plan and model.model.pp_plan == qwen.model.pp_plan
    assert model.supports_tp_plan and model.supports_pp_plan


def test_tah2_tp_plan_includes_the_lm_head_and_leaves_updater_and_decider_replicated():
    model = tiny_tah2(max_iterations=2)
    assert TaH2ForCausalLM._tp_plan["lm_head"] == "colwise_gather_output"
    assert "lm_head" in model.tp_plan
    loop_params = [n for n, _ in model.named_parameters() if n.startswith(("updater.", "decider."))]
    assert loop_params and all(plan_style(model.tp_plan, n) is None for n in loop_params)
    assert not any(fnmatch.fnmatch(n, pattern) for n in loop_params for pattern in model.tp_plan)


# ----------------------------------------------------------------------------------------------------------------------
# Cache crop: decoding after `crop` equals decoding the shorter prefix; assisted decoding and prompt lookup
# ----------------------------------------------------------------------------------------------------------------------


def _decode(model, ids, mask, chunks, cache):
    """Feed `ids` to `cache` call by call, each call ending at the next of `chunks`; the last position's logits."""
    out, start = None, cache.get_seq_length()
    for end in chunks:
        out = model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True).logits[:, -1:]
        start = end
    return out


def _count_rebuilds(monkeypatch):
    """SpiralFormer: how many crops were undone by re-prefilling (the others restored the latest call's snapshots)."""
    calls = []
    original = SpiralFormerModel._rebuild_after_crop

    def counted(self, *args, **kwargs):
        calls.append(args[2] if len(args) > 2 else None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SpiralFormerModel, "_rebuild_after_crop", counted)
    return calls


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("prefill,extend,remove", [(14, 4, 5), (9, 6, 2), (11, 1, 1), (12, 0, 3), (10, 5, 5)])
def test_crop_then_decode_equals_decoding_the_shorter_prefix(arch, prefill, extend, remove, monkeypatch):
    """Left-padded batch of two; the crop lands in the last extension call or inside the prefill."""
    rebuilds = _count_rebuilds(monkeypatch)
    model = BUILDERS[arch](2)
    ids = torch.randint(3, VOCAB, (2, 22), generator=torch.Generator().manual_seed(prefill + remove))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kept = prefill + extend - remove
    cache = DynamicCache()
    with torch.no_grad():
        _decode(model, ids, mask, [prefill, prefill + extend] if extend else [prefill], cache)
        cache.crop(-remove)
        assert cache.get_seq_length() == kept
        got = _decode(model, ids, mask, [kept + 3, kept + 4], cache)  # a multi-token call, then one token
        want = _decode(model, ids, mask, [kept, kept + 3, kept + 4], DynamicCache())
        full = model(ids[:, :kept + 4], attention_mask=mask[:, :kept + 4], use_cache=False).logits[:, -1:]
    assert (got - want).abs().max() <= 1e-5
    assert (got - full).abs().max() <= 1e-4
    if arch == "spiralformer":  # the kept inputs (fp32 embeddings + one position each) are what makes crop exact
        assert model.model.cache_bytes(cache)["inputs"] == 2 * (kept + 4) * (model.config.hidden_size + 1) * 4
        # a crop within the last extension call restores its snapshots; a deeper one re-prefills the kept tokens
        assert len(rebuilds) == (0 if remove <= extend else 1), rebuilds


def _count_crops(monkeypatch):
    from hf_loops.modeling.cache_tah2 import TaH2Cache

    calls = []
    for cls in (DynamicCache, TaH2Cache):
        original = cls.crop

        def counted(self, n, _original=original):
            calls.append(n)
            return _original(self, n)

        monkeypatch.setattr(cls, "crop", counted)
    return calls


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.slow
def test_assisted_decoding_and_prompt_lookup_give_the_greedy_tokens(arch, monkeypatch):
    model = BUILDERS[arch](2)
    assistant = tah2_model(2, seed=7) if arch == "tah2" else BUILDERS[arch](2, seed=7)  # a different model: rejections
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, VOCAB, (1, 5), generator=g)
    prompt = torch.cat([base, base, base[:, :3]], dim=1)  # repeated n-grams: prompt lookup has candidates
    crops, rebuilds = _count_crops(monkeypatch), _count_rebuilds(monkeypatch)
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=14, do_sample=False)
        assert not crops
        assisted = model.generate(prompt, max_new_tokens=14, do_sample=False, assistant_model=assistant)
        assert any(n < 0 for n in crops), "assisted decoding rejected no draft token: the test proves nothing"
        if arch == "spiralformer":  # only a crop into a model's first call (its prefill) re-prefills
            assert sum(n < 0 for n in crops) >= 4 and len(rebuilds) <= 2, (crops, rebuilds)  # main + assistant
        crops.clear()
        lookup = model.generate(prompt, max_new_tokens=14, do_sample=False, prompt_lookup_num_tokens=3)
        assert any(n < 0 for n in crops), "prompt lookup rejected no candidate: the test proves nothing"
    assert torch.equal(assisted, greedy)
    assert torch.equal(lookup, greedy)


# ----------------------------------------------------------------------------------------------------------------------
# TaH2's per-depth buffers grow with the depth reached, not with max_iterations
# ----------------------------------------------------------------------------------------------------------------------


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the bytes of the largest tensor any operator produces while active (CPU-robust: no allocator stats)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def stop_at_depth(model, depth: int):
    """A scripted decider: every token continues after depths < `depth` and stops after `depth`."""
    seen = {"calls": 0}

    def continue_logit(embeds, hidden, logits):
        seen["calls"] += 1
        g = 0.9 if seen["calls"] < depth else 0.1
        return torch.logit(torch.full(embeds.shape[:1], g, dtype=torch.float32, device=embeds.device))

    def reset():
        seen["calls"] = 0

    model._continue_logit = continue_logit
    return reset


@pytest.mark.parametrize("labels", [False, True])
def test_a_huge_max_iterations_costs_what_the_reached_depth_costs(labels):
    model = tiny_tah2(max_iterations=2, decisive=False)
    reset = stop_at_depth(model, 2)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    outs, largest = {}, {}
    for M in (2, 10**9):
        reset()
        with torch.no_grad(), LargestTensor() as spy:
            outs[M] = model(ids, attention_mask=mask, labels=ids if labels else None, max_iterations=M,
                            use_cache=False, return_mixture_logits=labels)
        largest[M] = spy.largest
    small, huge = outs[2], outs[10**9]
    assert torch.equal(small.iter_counts, huge.iter_counts) and int(huge.iter_counts.max()) == 2
    assert torch.equal(small.logits, huge.logits)
    if labels:
        assert torch.equal(small.loss, huge.loss)
    # M = 2: the decision after depth 1 only; M = 10**9: also the (stop) decision after depth 2
    assert small.continue_probs.shape == (2, 9, 1) and huge.continue_probs.shape == (2, 9, 2)
    torch.testing.assert_close(small.continue_probs, huge.continue_probs[..., :1], equal_nan=True)
    assert largest[10**9] <= largest[2] * 1.01, largest


def test_continue_probs_width_is_the_deepest_executed_depth_capped_at_m_minus_1():
    model = tiny_tah2(max_iterations=4, decisive=False)
    reset = stop_at_depth(model, 3)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for M, width in [(1, 0), (2, 1), (3, 2), (4, 3), (6, 3)]:
            reset()
            out = model(ids, max_iterations=M, use_cache=False)
            assert int(out.iter_counts.max()) == min(M, 3)
            assert out.continue_probs.shape[-1] == width, (M, out.continue_probs.shape)
            assert not torch.isnan(out.continue_probs).any()  # every token ran every depth up to the stop
