"""TaH2's attention backends. flex_attention: the cross-iteration visibility goes through a `BlockMask` (built once per depth pass)
and gives the eager answer — full forward with left padding, cached decoding (ragged deeper streams), causality.

The mask checks run transformers' flex path with torch's dense flex kernel (`helpers.flex.uncompiled_flex`): on CPU
the compiled kernel is built once per shape (static shapes: see `loop_utils.flex_cpu_guard`), seconds each, and a
looped model meets a new shape at every depth pass. One test runs the compiled kernel on a full forward.
flash-attention: stream 0 only (checked with a stand-in kernel; flash-attn does not build here), the deeper depths
under sdpa."""

import pytest
import torch
from helpers.flex import uncompiled_flex
from helpers.tah2_helpers import pattern_by_hidden, script_decider, tiny_tah2

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def dense_flex(monkeypatch):
    uncompiled_flex(monkeypatch)


@pytest.fixture(scope="module")
def models():
    out = {}
    for mode in ("duo",):
        eager = script_decider(tiny_tah2(max_iterations=3, iteration_attention=mode), pattern_by_hidden)
        eager.set_attn_implementation("eager")
        flex = script_decider(tiny_tah2(max_iterations=3, iteration_attention=mode), pattern_by_hidden)
        flex.set_attn_implementation("flex_attention")
        out[mode] = (eager, flex)
    return out


def _batch():
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(3, 97, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask


def _full_forward_equals_eager(models):
    eager, flex = models["duo"]
    ids, mask = _batch()
    with torch.no_grad():
        a, b = eager(ids, attention_mask=mask), flex(ids, attention_mask=mask)
    real = mask.bool()
    assert torch.equal(a.iter_counts, b.iter_counts)
    assert a.iter_counts.max() == 3 and a.iter_counts[real].min() == 1
    assert (a.logits - b.logits)[real].abs().max() <= 1e-5


def test_flex_full_forward_equals_eager(models, dense_flex):
    _full_forward_equals_eager(models)


@pytest.mark.slow
def test_compiled_flex_full_forward_equals_eager(models):
    """The kernel users get on CPU: compiled per shape under `flex_cpu_guard` (three depth passes, three shapes)."""
    torch._dynamo.reset()  # compile from a clean state whatever other tests compiled before in this process
    _full_forward_equals_eager(models)


def test_flex_cached_decode_equals_eager_full_forward(models, dense_flex):
    eager, flex = models["duo"]
    ids, mask = _batch()
    with torch.no_grad():
        full = eager(ids, attention_mask=mask, use_cache=False, max_iterations=2)
        out = flex(ids[:, :9], attention_mask=mask[:, :9], use_cache=True, max_iterations=2)
        logits, cache = [out.logits], out.cache
        for t in range(9, 11):
            out = flex(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True, max_iterations=2)
            logits.append(out.logits)
    real = mask.bool()
    assert (torch.cat(logits, 1) - full.logits)[real].abs().max() <= 1e-5


def test_flex_backward_on_cpu_is_torchs_limit_not_ours(models, monkeypatch):
    """Training under flex needs an accelerator: torch 2.13 has no CPU backward for flex_attention."""
    uncompiled_flex(monkeypatch, backward=True)
    _, flex = models["duo"]
    ids, mask = _batch()
    flex.train()
    try:
        with pytest.raises(NotImplementedError, match="backward on CPU"):
            flex(ids, attention_mask=mask, labels=ids).loss.backward()
    finally:
        flex.eval()


def test_flash_attention_runs_stream_zero_and_sdpa_runs_the_deeper_depths(monkeypatch):
    """flash-attn cannot be installed here: a stand-in kernel under the flash name checks what flash would receive
    (never an explicit 4-D mask: only the plain causal stream-0 passes go to it) and computes causal attention with
    key padding; the deeper depths must then run under sdpa, and the answer must equal eager's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def fake_flash(module, query, key, value, attention_mask, **kwargs):
        assert attention_mask is None or attention_mask.dim() == 2, "flash got an explicit mask"
        T, S = query.shape[-2], key.shape[-2]
        allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None].expand(query.shape[0], 1, T, S)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, -S:].bool()
        calls.append((T, S))
        return sdpa_attention_forward(module, query, key, value, allowed, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", fake_flash)
    eager = script_decider(tiny_tah2(max_iterations=3), pattern_by_hidden)
    eager.set_attn_implementation("eager")
    flash = script_decider(tiny_tah2(max_iterations=3), pattern_by_hidden)
    flash.config._attn_implementation_internal = "flash_attention_2"  # the package check would refuse here
    ids, mask = _batch()
    with torch.no_grad():
        a = eager(ids, attention_mask=mask)
        b = flash(ids, attention_mask=mask)
        layers = flash.config.num_hidden_layers
        assert calls == [(11, 11)] * layers  # depth 1 only; depths 2 and 3 ran under sdpa
        assert flash.config._attn_implementation == "flash_attention_2"
        cache = flash(ids[:, :9], attention_mask=mask[:, :9], use_cache=True).cache
        step = flash(ids[:, 9:10], attention_mask=mask[:, :10], cache=cache, use_cache=True)
    real = mask.bool()
    assert torch.equal(a.iter_counts, b.iter_counts) and a.iter_counts.max() == 3
    assert (a.logits - b.logits)[real].abs().max() <= 1e-5
    assert (step.logits[:, -1] - a.logits[:, 9]).abs().max() <= 1e-5
    assert calls[-1] == (1, 10)


def test_flex_causality_a_later_token_never_changes_earlier_outputs(models, dense_flex):
    _, flex = models["duo"]
    ids, mask = _batch()
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 11) % 97
    with torch.no_grad():
        a, b = flex(ids, attention_mask=mask), flex(changed, attention_mask=mask)
    assert torch.equal(a.iter_counts[:, :8], b.iter_counts[:, :8])
    assert (a.logits[:, :8] - b.logits[:, :8])[mask[:, :8].bool()].abs().max() <= 1e-6
    assert (a.logits[:, 8:] - b.logits[:, 8:]).abs().max() > 1e-3
