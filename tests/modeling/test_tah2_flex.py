"""TaH2 under flex_attention: the cross-iteration visibility goes through a `BlockMask` (built once per depth pass)
and gives the eager answer — full forward with left padding, cached decoding (ragged deeper streams).

flex compiles its kernel once per shape on CPU (static shapes: see `loop_utils.flex_cpu_guard`), so the cases are few
and share one module-scoped model."""

import pytest
import torch
from tah2_helpers import pattern_by_hidden, script_decider, tiny_tah2

pytest.importorskip("torch.nn.attention.flex_attention")


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


def test_flex_full_forward_equals_eager(models):
    eager, flex = models["duo"]
    ids, mask = _batch()
    with torch.no_grad():
        a, b = eager(ids, attention_mask=mask), flex(ids, attention_mask=mask)
    real = mask.bool()
    assert torch.equal(a.iter_counts, b.iter_counts)
    assert a.iter_counts.max() == 3 and a.iter_counts[real].min() == 1
    assert (a.logits - b.logits)[real].abs().max() <= 1e-5


def test_flex_cached_decode_equals_eager_full_forward(models):
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


def test_flex_backward_on_cpu_is_torchs_limit_not_ours(models):
    """Training under flex needs an accelerator: torch 2.13 has no CPU backward for flex_attention."""
    _, flex = models["duo"]
    ids, mask = _batch()
    flex.train()
    try:
        with pytest.raises(NotImplementedError, match="backward on CPU"):
            flex(ids, attention_mask=mask, labels=ids).loss.backward()
    finally:
        flex.eval()
