"""SGT on transformers' attention backends: sdpa and flex_attention equal eager (prefill, cached decode, left padding,
gradients, entropy probe); unsupported `attn_implementation` values raise a clear ValueError (issue 14).

flex_attention on CPU is compiled by transformers (torch.compile of `flex_attention` and `create_block_mask`), which
costs up to a minute per new shape on a cold 2-core machine. The `eager_flex` fixture runs the same transformers
integration (the `BlockMask` from `create_causal_mask`, the same `flex_attention` call) with torch's dense reference
kernel (`helpers.flex.uncompiled_flex`); `test_compiled_flex_attention_equals_eager` runs the compiled kernel and is
opt-in (HF_LOOPS_COMPILED_FLEX=1).
"""

from __future__ import annotations

import pytest
import torch
from helpers.flex import COMPILED_FLEX, uncompiled_flex

import hf_loops  # noqa: F401  (registers the Auto classes)
from hf_loops import SGTConfig, SGTForCausalLM
from hf_loops.modeling.modeling_sgt import ATTENTION_IMPLEMENTATIONS

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
PLAN = [{"layer": 1, "heads": [0, 3], "depth": 2}, {"layer": 2, "heads": [1], "depth": 1}]
BACKENDS = ["sdpa", "flex_attention"]
VARIANTS = ["sliced", "masked", "block"]


@pytest.fixture
def eager_flex(monkeypatch):
    """transformers' flex path with torch's dense flex kernel and uncompiled block-mask construction."""
    uncompiled_flex(monkeypatch)


def make(variant="sliced", attn="eager", seed=0) -> SGTForCausalLM:
    torch.manual_seed(seed)
    if variant == "block":
        config = SGTConfig(**BASE, loop_mode="block", block_loop_layers=[0, 2], block_loop_depth=1)
    else:
        config = SGTConfig(**BASE, loop_plan=PLAN)
    model = SGTForCausalLM(config).eval()
    if variant == "masked":  # the reference path, with one decaying gate
        for layer in model.model.layers:
            if layer.loop_depth:
                layer.loop_masked = True
        model.model.set_loop(1, [0, 3], 2, gates=[1.0, 0.4, 0.0, 1.0])
    model.set_attn_implementation(attn)
    return model


def as_backend(model, attn) -> SGTForCausalLM:
    model.set_attn_implementation(attn)
    return model


def padded_batch():
    """Row 0: 8 tokens; row 1: 5 tokens left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, VOCAB, (2, 8), generator=g)
    x[1, :3] = 0
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    return x, mask


# ---------------------------------------------------------------------------------------------------------------------
# which backends
# ---------------------------------------------------------------------------------------------------------------------


# "paged|eager" is allowed: continuous batching switches eager to it (tests/serving/test_continuous_batching.py)
@pytest.mark.parametrize("attn", ["flash_attention_3", "paged|sdpa", "no_such_kernel"])
def test_unsupported_attn_implementation_raises(attn):
    with pytest.raises(ValueError, match=r"attn_implementation=.*allowed values: 'eager', 'sdpa', 'flex_attention'"):
        SGTForCausalLM(SGTConfig(**BASE, loop_plan=PLAN, attn_implementation=attn))
    model = make()
    with pytest.raises(ValueError, match="attn_implementation"):
        model.set_attn_implementation(attn)
    assert model.config._attn_implementation == "eager"


def test_custom_attention_function_needs_a_mask_function_too():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("sgt_test_attention", sdpa_attention_forward)
    with pytest.raises(ValueError, match="AttentionMaskInterface"):
        make(attn="sgt_test_attention")
    AttentionMaskInterface.register("sgt_test_attention", sdpa_mask)
    model = make(attn="sgt_test_attention")
    x, mask = padded_batch()
    with torch.no_grad():
        got = model(x, attention_mask=mask).logits
        ref = as_backend(model, "eager")(x, attention_mask=mask).logits
    assert (got[0] - ref[0]).abs().max().item() < 1e-5


def test_supported_backends_load():
    assert ATTENTION_IMPLEMENTATIONS == ("eager", "sdpa", "flex_attention", "flash_attention_2", "paged|eager")
    for attn in ("eager", "sdpa", "flex_attention"):
        assert make(attn=attn).config._attn_implementation == attn
    try:  # flash_attention_2 is allowed by SGT: without flash-attn installed only transformers' own check fails
        make(attn="flash_attention_2")
    except (ImportError, ValueError) as err:
        assert "SGT does not support" not in str(err)


# ---------------------------------------------------------------------------------------------------------------------
# equality with eager
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.slow
def test_prefill_equals_eager(attn, variant, eager_flex):
    model = make(variant)
    x, mask = padded_batch()
    with torch.no_grad():
        ref = model(x, attention_mask=mask).logits
        ref_plain = model(x).logits
        as_backend(model, attn)
        got = model(x, attention_mask=mask).logits
        got_plain = model(x).logits
    assert (got[0] - ref[0]).abs().max().item() < 1e-5
    assert (got[1, 3:] - ref[1, 3:]).abs().max().item() < 1e-5
    assert (got_plain - ref_plain).abs().max().item() < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.slow
def test_cached_decode_equals_eager_full_forward(attn, variant, eager_flex):
    model = make(variant)
    x, mask = padded_batch()
    with torch.no_grad():
        full = model(x, attention_mask=mask).logits  # eager, no cache
        as_backend(model, attn)
        out = model(x[:, :4], attention_mask=mask[:, :4], use_cache=True)  # prefill
        steps = [out.logits]
        out = model(x[:, 4:6], attention_mask=mask[:, :6], cache=out.cache, use_cache=True)  # a chunk
        steps.append(out.logits)
        for i in range(6, 8):  # token by token
            out = model(x[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    got = torch.cat(steps, 1)
    assert (got[0] - full[0]).abs().max().item() < 1e-5
    assert (got[1, 3:] - full[1, 3:]).abs().max().item() < 1e-5


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.slow
def test_left_padding_equals_rows_alone(attn, eager_flex):
    model = make(attn=attn)
    x, mask = padded_batch()
    with torch.no_grad():
        batch = model(x, attention_mask=mask).logits
        alone = [model(x[:1]).logits[0], model(x[1:, 3:]).logits[0]]
        gen_batch = model.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)
        gen_alone = model.generate(x[1:, 3:], max_new_tokens=4, do_sample=False)
        cached = model.generate(x[:1], max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = model.generate(x[:1], max_new_tokens=4, do_sample=False, use_cache=False)
    assert (batch[0] - alone[0]).abs().max().item() < 1e-5
    assert (batch[1, 3:] - alone[1]).abs().max().item() < 1e-5
    assert torch.equal(gen_batch[1, 3:], gen_alone[0])
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.slow
def test_training_loss_and_gradients_equal_eager(attn, eager_flex):
    """Train-mode loss; gradients too where the backend has a CPU backward (torch's flex_attention has none)."""
    x, mask = padded_batch()
    labels = x.clone()
    labels[1, :4] = -100  # padding, and the first real token (predicted from a padding position)
    backward = attn != "flex_attention"
    grads = {}
    for name in ("eager", attn):
        model = make(attn=name).train()
        with torch.set_grad_enabled(backward):
            loss = model(x, attention_mask=mask, labels=labels).loss
        if backward:
            loss.backward()
        grads[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (loss_ref, g_ref), (loss, g) = grads["eager"], grads[attn]
    assert abs(loss.item() - loss_ref.item()) < 1e-5
    if backward:
        assert g.keys() == g_ref.keys() and len(g) > 0
        assert max((g[n] - g_ref[n]).abs().max().item() for n in g) < 1e-5


@pytest.mark.parametrize("attn", BACKENDS)
def test_entropy_probe_equals_eager(attn, eager_flex):
    x, mask = padded_batch()
    stats = {}
    for name in ("eager", attn):
        model = make(attn=name).train()
        model.model.set_entropy_statistics(True)
        with torch.no_grad():
            model(x, attention_mask=mask)
        stats[name] = model.model.pop_entropy_statistics(2)
    assert torch.equal(stats[attn][1], stats["eager"][1])
    assert stats["eager"][1].sum() > 0
    assert (stats[attn][0] - stats["eager"][0]).abs().max().item() < 1e-5


@COMPILED_FLEX
def test_compiled_flex_attention_equals_eager():
    """The compiled kernel: left-padded prefill + cached decode steps. On CPU, `SGTModel.forward` compiles flex for
    static shapes (`loop_utils.flex_cpu_guard`): torch 2.13's dynamic-shape CPU flex kernel does not build for a
    padded decode step (`cur_kvSplitSize1` undeclared), for plain `Qwen3ForCausalLM` too."""
    model = make()
    x, mask = padded_batch()
    with torch.no_grad():
        ref = model(x, attention_mask=mask).logits
        as_backend(model, "flex_attention")
        out = model(x[:, :6], attention_mask=mask[:, :6], use_cache=True)
        steps = [out.logits]
        for i in range(6, 8):
            out = model(x[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    got = torch.cat(steps, 1)
    assert (got[0] - ref[0]).abs().max().item() < 1e-5
    assert (got[1, 3:] - ref[1, 3:]).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# head layouts of the sliced loop (weight views vs index_select, interface GQA vs per-head K/V)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [[0, 1], [0, 1, 2], [1, 2], [0, 1, 2, 3], [3], [0, 2, 3]])
@pytest.mark.parametrize("attn", ["eager"] + BACKENDS)
@pytest.mark.slow
def test_sliced_head_layouts_equal_masked_with_and_without_cache(heads, attn, eager_flex):
    """GQA (4 query heads, 2 kv heads): one kv head serving two kept heads (interface GQA), uneven groups (K/V
    expanded per head), contiguous query rows (weight views), all heads (the whole weights), a single head."""
    torch.manual_seed(0)
    model = SGTForCausalLM(SGTConfig(**BASE, loop_plan=[{"layer": 1, "heads": heads, "depth": 2}])).eval()
    model.set_attn_implementation(attn)
    x, mask = padded_batch()
    with torch.no_grad():
        sliced = model(x, attention_mask=mask).logits
        out = model(x[:, :5], attention_mask=mask[:, :5], use_cache=True)
        steps = [out.logits]
        for i in range(5, 8):
            out = model(x[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        model.model.layers[1].loop_masked = True
        masked = model(x, attention_mask=mask).logits
    cached = torch.cat(steps, 1)
    for got in (sliced, cached):
        assert (got[0] - masked[0]).abs().max().item() < 1e-5
        assert (got[1, 3:] - masked[1, 3:]).abs().max().item() < 1e-5
    assert out.cache.layers[3].keys.shape[1] == len({h // 2 for h in heads})


@pytest.mark.parametrize("heads", [[0, 1], [0, 1, 2], [1, 2], [0, 1, 2, 3]])
def test_sliced_head_layouts_gradients_equal_masked(heads):
    x = padded_batch()[0][:1]
    grads = []
    for masked in (False, True):
        torch.manual_seed(0)
        model = SGTForCausalLM(SGTConfig(**BASE, loop_plan=[{"layer": 1, "heads": heads, "depth": 2}]))
        model.model.layers[1].loop_masked = masked
        model(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) < 1e-5
