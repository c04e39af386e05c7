"""`output_hidden_states` / `output_attentions` for SGT and SpiralFormer (TaH2's are in test_tah2.py): per-layer
states in Qwen3's convention where the model has them, a clear error where it does not — never a silent no-op."""

import pytest
import torch
from helpers.common import tiny_qwen3_config
from transformers import Qwen3ForCausalLM

from hf_loops import SGTConfig, SpiralFormerConfig
from hf_loops.modeling.modeling_sgt import SGTForCausalLM
from hf_loops.modeling.modeling_spiralformer import SpiralFormerForCausalLM


def _ids(B=2, T=16):
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(0))


def _sgt_and_qwen(plan=None, attn="sdpa"):
    torch.manual_seed(0)
    q = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=3)).eval()
    sgt = SGTForCausalLM(SGTConfig(**{**q.config.to_dict(), "loop_plan": plan})).eval()
    sgt.load_state_dict(q.state_dict())
    q.config._attn_implementation = attn
    sgt.config._attn_implementation = attn
    return sgt, q


def test_sgt_without_loops_returns_qwen3s_hidden_states_and_eager_attentions():
    sgt, q = _sgt_and_qwen(attn="eager")
    ids = _ids()
    with torch.no_grad():
        a = sgt(ids, output_hidden_states=True, output_attentions=True)
        b = q(ids, output_hidden_states=True, output_attentions=True)
    assert len(a.hidden_states) == len(b.hidden_states) == 4 and len(a.attentions) == 3
    for x, y in zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions, strict=False):
        torch.testing.assert_close(x, y)


def test_sgt_looped_layers_report_their_output_and_first_pass_weights():
    sgt, _ = _sgt_and_qwen(plan=[{"layer": 1, "heads": [0, 3], "depth": 2}], attn="eager")
    ids = _ids()
    with torch.no_grad():
        out = sgt(ids, output_hidden_states=True, output_attentions=True)
        plain = sgt(ids)
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    assert out.attentions[1].shape == (2, 4, 16, 16)
    torch.testing.assert_close(sgt.lm_head(out.hidden_states[-1]), plain.logits)
    assert plain.hidden_states is None and plain.attentions is None


def test_sgt_output_attentions_under_sdpa_is_a_clear_error():
    sgt, _ = _sgt_and_qwen()
    with pytest.raises(ValueError, match="output_attentions=True needs attn_implementation='eager'"):
        sgt(_ids(), output_attentions=True)


def _spiral():
    torch.manual_seed(0)
    cfg = SpiralFormerConfig(**{**tiny_qwen3_config(num_hidden_layers=4).to_dict(), "num_pre_layers": 1,
                                "num_loop_layers": 2, "num_post_layers": 1})
    return SpiralFormerForCausalLM(cfg).eval()


def test_spiralformer_hidden_states_are_the_full_resolution_stream():
    model = _spiral()
    ids = _ids()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        plain = model(ids)
    T = len(model.config.chunk_sizes)
    assert len(out.hidden_states) == 1 + (T - 1) + 1 + 1  # pre input, after steps 1..T-1, post input, final
    assert all(h.shape == (2, 16, model.config.hidden_size) for h in out.hidden_states)
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), plain.logits)
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))


def test_spiralformer_refuses_attentions_and_cached_hidden_states_clearly():
    model = _spiral()
    ids = _ids()
    with pytest.raises(ValueError, match="output_attentions is not supported by SpiralFormer"):
        model(ids, output_attentions=True)
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).cache
    with pytest.raises(ValueError, match="output_hidden_states needs a full forward"):
        model(ids[:, 8:9], cache=cache, use_cache=True, output_hidden_states=True)
