"""TaH2 model plugin: exactness, mixture, masks, causality, cache, generate, packing, validation."""

import math

import pytest
import torch
from helpers.tah2_helpers import min_margin, pattern_by_hidden, pattern_by_sign, script_decider, tiny_qwen3, tiny_tah2
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3ForCausalLM

import hf_loops
from hf_loops import TaH2Config, TaH2ForCausalLM
from hf_loops.conversion import convert_qwen3
from hf_loops.core.compat import cache_kwargs, cache_of
from hf_loops.modeling.modeling_tah2 import TaH2Decider, TaH2Updater, iteration_visibility

MODES = ["duo", "causal", "same_iter"]


# ---------------------------------------------------------------------------------------------------------------------
# 1. Exactness against Qwen3
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_m1_equals_qwen3_logits(tied):
    q = tiny_qwen3(tie_word_embeddings=tied)
    model = convert_qwen3(q, "tah2", max_iterations=1).eval()
    assert model.config.tie_word_embeddings == tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ref = q(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    assert (ref[0] - got[0]).abs().max() <= 1e-5
    assert (ref[1, 3:] - got[1, 3:]).abs().max() <= 1e-5


def test_never_decider_gives_log_softmax_of_qwen3():
    q = tiny_qwen3()
    model = convert_qwen3(q, "tah2", max_iterations=3, decider="never").eval()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.log_softmax(q(ids).logits.float(), -1)
        out = model(ids)
    assert (out.logits - ref).abs().max() <= 1e-5
    assert torch.all(out.iter_counts == 1)


def test_standard_preset_has_no_new_parameters():
    q = tiny_qwen3()
    model = convert_qwen3(q, "tah2", **hf_loops.TAH2_PRESETS["standard"])
    assert model.updater is None and model.decider is None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in q.parameters())


def test_parameter_counts_match_paper_table7():
    cfg = TaH2Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936)
    with torch.device("meta"):
        upd, dec = TaH2Updater(cfg), TaH2Decider(cfg)
    assert sum(p.numel() for p in upd.parameters()) == 20_979_712
    assert sum(p.numel() for p in dec.parameters()) == 25_176_064


# ---------------------------------------------------------------------------------------------------------------------
# 2. Stopping-weighted mixture (Eq. 4)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g,expect_depth", [(0.8, 2), (0.3, 1)])
def test_mixture_hand_example(g, expect_depth):
    model = tiny_tah2(max_iterations=2)
    script_decider(model, lambda e, h: torch.full(e.shape[:-1], g))
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        qs = [torch.softmax(model.lm_head(h).float(), -1) for h in out.iteration_hidden_states]
    assert torch.all(out.iter_counts == expect_depth) and len(qs) == expect_depth
    expected = (1 - g) * qs[0] + g * qs[1] if expect_depth == 2 else qs[0]
    assert (out.logits.exp() - expected).abs().max() <= 1e-6
    assert torch.allclose(out.logits.exp().sum(-1), torch.ones(1, 6), atol=1e-5)


def test_mixture_weights_sum_to_one_m3_and_even_and_final():
    for mixture in ["stop_prob", "even", "final"]:
        model = tiny_tah2(max_iterations=3, mixture=mixture)
        script_decider(model, lambda e, h: torch.full(e.shape[:-1], 0.7))  # everyone runs 3 depths
        ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            qs = [torch.softmax(model.lm_head(h).float(), -1) for h in out.iteration_hidden_states]
        w = {"stop_prob": [0.3, 0.7 * 0.3, 0.7 * 0.7], "even": [1 / 3] * 3, "final": [0, 0, 1]}[mixture]
        assert math.isclose(sum(w), 1.0)
        expected = sum(wi * qi for wi, qi in zip(w, qs, strict=False))
        assert (out.logits.exp() - expected).abs().max() <= 1e-6, mixture


# ---------------------------------------------------------------------------------------------------------------------
# 3. Visibility predicates, entry by entry, and causality
# ---------------------------------------------------------------------------------------------------------------------


def _reference_visible(mode, qp, d, kp, ki, kv, kc):
    """The spec's table, written out as plain conditions."""
    if not kv or ki > d or kp > qp:
        return False
    if mode == "causal":
        return ki == 0 or (kp == qp and ki <= d)
    if mode == "duo":
        return ki <= d
    if mode == "same_iter":
        return ki == d
    return ki < d or kc or kp == qp  # duo_posterior


@pytest.mark.parametrize("mode", MODES + ["duo_posterior"])
def test_visibility_table_entry_by_entry(mode):
    # 4 tokens (positions 0..3), 3 streams; stream 1 holds tokens 0, 2, 3; stream 2 holds tokens 2, 3; one pad key.
    key_pos = torch.tensor([[0, 1, 2, 3, 0, 2, 3, 2, 3, 1]])
    key_iter = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    key_valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]]).bool()
    key_cont = torch.tensor([[1, 0, 1, 1, 0, 1, 0, 0, 0, 0]]).bool()
    for d in range(3):
        query_pos = torch.tensor([[0, 1, 2, 3]])
        got = iteration_visibility(mode, query_pos, d, key_pos, key_iter, key_valid, key_continue=key_cont)
        for qi in range(4):
            for k in range(key_pos.shape[1]):
                want = _reference_visible(mode, qi, d, int(key_pos[0, k]), int(key_iter[0, k]),
                                          bool(key_valid[0, k]), bool(key_cont[0, k]))
                assert bool(got[0, qi, k]) == want, (mode, d, qi, k)


def test_visibility_tabulated_duo_example():
    """Query at position 2, depth index 1 (duo): sees stream 0 of positions ≤ 2 and stream 1 of tokens 0 and 2."""
    key_pos = torch.tensor([[0, 1, 2, 3, 0, 2, 3, 2]])
    key_iter = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    got = iteration_visibility("duo", torch.tensor([[2]]), 1, key_pos, key_iter, valid)
    assert got[0, 0].tolist() == [True, True, True, False, True, True, False, False]
    got = iteration_visibility("causal", torch.tensor([[2]]), 1, key_pos, key_iter, valid)
    assert got[0, 0].tolist() == [True, True, True, False, False, True, False, False]
    got = iteration_visibility("same_iter", torch.tensor([[2]]), 1, key_pos, key_iter, valid)
    assert got[0, 0].tolist() == [False, False, False, False, True, True, False, False]


def test_visibility_rejects_unknown_mode():
    z = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="duo_posterior"):
        iteration_visibility("bidirectional", z, 0, z, z, z.bool())


@pytest.mark.parametrize("mode", MODES)
def test_causality_later_token_never_changes_earlier_outputs(mode):
    model = tiny_tah2(max_iterations=3, iteration_attention=mode)
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(ids)
        for p in (3, 7):
            changed = ids.clone()
            changed[0, p] = (changed[0, p] + 11) % 97
            out = model(changed)
            assert torch.equal(out.iter_counts[:, :p], base.iter_counts[:, :p])
            assert (out.logits[:, :p] - base.logits[:, :p]).abs().max() <= 1e-6  # float noise only
            assert (out.logits[:, p:] - base.logits[:, p:]).abs().max() > 1e-3  # the change is visible later


# ---------------------------------------------------------------------------------------------------------------------
# 4. Cache: prefill + token-by-token == one full forward
# ---------------------------------------------------------------------------------------------------------------------


def _incremental(model, ids, prefill, **kw):
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True, **kw)
        logits, depths, cache = [out.logits], [out.iter_counts], out.cache
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True, **kw)
            cache = out.cache
            logits.append(out.logits)
            depths.append(out.iter_counts)
    return torch.cat(logits, 1), torch.cat(depths, 1), cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [2, 3])
def test_cache_equals_full_forward_scripted_decider(mode, M):
    model = script_decider(tiny_tah2(max_iterations=M, iteration_attention=mode), pattern_by_sign)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids, use_cache=False)
    assert full.iter_counts.min() == 1 and full.iter_counts.max() == M  # the pattern really mixes depths
    logits, depths, cache = _incremental(model, ids, prefill=4)
    assert torch.equal(depths, full.iter_counts)
    assert (logits - full.logits).abs().max() <= 1e-5
    assert cache.get_seq_length() == 9
    assert torch.equal(cache.token_depth, full.iter_counts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [2, 3])
def test_cache_equals_full_forward_learned_decider(mode, M):
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    for seed in range(20):  # a seed whose decisions sit clearly away from τ
        model = tiny_tah2(seed=seed, max_iterations=M, iteration_attention=mode)
        if min_margin(model, ids) > 1e-3:
            break
    with torch.no_grad():
        full = model(ids, use_cache=False)
    logits, depths, _ = _incremental(model, ids, prefill=3)
    assert torch.equal(depths, full.iter_counts)
    assert (logits - full.logits).abs().max() <= 1e-5


def test_deeper_streams_hold_only_tokens_that_ran_that_depth():
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_sign)
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.cache
    deep = cache.stream_metadata(1)
    n_deep = int((out.iter_counts >= 2).sum())
    assert int(deep["valid"].sum()) == n_deep
    assert cache.layers[cache.kv_slot(1, 0)].keys.shape[-2] == n_deep  # B = 1: no padding columns
    assert cache.layers[cache.kv_slot(0, 0)].keys.shape[-2] == 12


def test_causal_mode_drops_deeper_streams_from_the_cache():
    model = tiny_tah2(max_iterations=3, iteration_attention="causal", decider="always", mixture="even")
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.cache.num_streams == 1
    assert torch.all(out.cache.token_depth == 3)


def test_crop_then_decode_equals_fresh_run():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_sign)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(9))
    _, _, cache = _incremental(model, ids, prefill=5)
    cache.crop(-3)  # back to 7 tokens
    assert cache.get_seq_length() == 7
    with torch.no_grad():
        out = model(ids[:, 7:], cache=cache, use_cache=True)
        full = model(ids, use_cache=False)
    assert torch.equal(out.iter_counts, full.iter_counts[:, 7:])
    assert (out.logits - full.logits[:, 7:]).abs().max() <= 1e-5


def test_per_call_overrides():
    model = tiny_tah2(max_iterations=2)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        one = model(ids, max_iterations=1)
        deep = model(ids, max_iterations=4, exit_threshold=0.01)
        default = model(ids)
        shallow = model(ids, exit_threshold=0.99)
        ref = tiny_qwen3()(ids).logits
    assert (one.logits - ref).abs().max() <= 1e-5
    assert int(deep.iter_counts.max()) == 4 and deep.continue_probs.shape[-1] == 3
    assert default.iter_counts.max() <= 2 and default.iter_counts.float().mean() < deep.iter_counts.float().mean()
    # A higher threshold stops at least as early at depth 1.
    assert torch.all((shallow.iter_counts >= 2) <= (default.iter_counts >= 2))
    with pytest.raises(ValueError, match="max_iterations"):
        model(ids, max_iterations=0)
    with pytest.raises(ValueError, match="exit_threshold"):
        model(ids, exit_threshold=1.0)


# ---------------------------------------------------------------------------------------------------------------------
# 5. generate
# ---------------------------------------------------------------------------------------------------------------------


def _gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_generate_cache_equals_no_cache(mode):
    model = script_decider(tiny_tah2(max_iterations=3, iteration_attention=mode), pattern_by_sign)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(11))
    a = _gen(model, ids, use_cache=True)
    b = _gen(model, ids, use_cache=False)
    assert torch.equal(a, b)


def test_generate_left_padded_batch_equals_single_rows():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_sign)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (6, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    batch = _gen(model, ids, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone = _gen(model, p[None])
        assert torch.equal(batch[i, width:], alone[0, len(p):]), i


def test_beam_search_cache_equals_no_cache():
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_sign)
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(13))
    a = _gen(model, ids, num_beams=3, use_cache=True)
    b = _gen(model, ids, num_beams=3, use_cache=False)
    assert torch.equal(a, b)


def test_generate_sampling_and_per_call_knobs():
    model = tiny_tah2(max_iterations=2)
    ids = torch.randint(3, 97, (2, 4), generator=torch.Generator().manual_seed(14))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=10, pad_token_id=0)
    assert out.shape == (2, 9)
    one = _gen(model, ids, max_iterations=1)
    ref = _gen(tiny_qwen3(), ids)
    assert torch.equal(one, ref)
    fresh = tiny_tah2(max_iterations=2, decisive=False)  # fresh decider: g ≈ 0.5
    hi = _gen(fresh, ids, exit_threshold=0.99)  # nobody continues: the Standard answer
    assert torch.equal(hi, ref)


def test_generate_uses_a_config_sized_cache_in_place():
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_sign)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(15))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, pad_token_id=0,
                             **cache_kwargs(cache))
    assert cache_of(out) is cache
    assert len(cache.layers) >= 2 * (model.config.num_hidden_layers + 1)
    assert cache.get_seq_length() == 8  # the last generated token is not fed back


# ---------------------------------------------------------------------------------------------------------------------
# 6. Backends and packing
# ---------------------------------------------------------------------------------------------------------------------


def test_eager_and_sdpa_agree():
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(16))
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_sign)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        a = model(ids, attention_mask=mask)
        model.set_attn_implementation("eager")
        b = model(ids, attention_mask=mask)
    assert torch.equal(a.iter_counts, b.iter_counts)
    assert (a.logits[0, 2:] - b.logits[0, 2:]).abs().max() <= 1e-5
    assert (a.logits[1] - b.logits[1]).abs().max() <= 1e-5


def test_only_active_tokens_run_deeper():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_hidden)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args, kw=None: seen.append(args[0].shape[:2]),
                                                    with_kwargs=False)
    ids = torch.randint(3, 97, (1, 16), generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        out = model(ids)
    active = [int((out.iter_counts >= m).sum()) for m in (1, 2, 3)]
    assert active[1] < 16 and active[2] < active[1]
    assert [b * t for b, t in seen] == active
    assert list(out.rows_per_depth) == active
    # One decode step over a batch: rows that stopped do no deeper work.
    with torch.no_grad():
        pre = model(ids[:, :15].repeat(4, 1), use_cache=True)
        seen.clear()
        nxt = torch.tensor([[5], [60], [7], [90]])
        step = model(nxt, cache=pre.cache, use_cache=True)
    assert [b * t for b, t in seen] == [int((step.iter_counts >= m).sum()) for m in (1, 2, 3)][: len(seen)]


def test_packed_rows_equal_separate_sequences():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_sign)
    g = torch.Generator().manual_seed(18)
    a, b = torch.randint(3, 97, (1, 5), generator=g), torch.randint(3, 97, (1, 4), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        out = model(packed, position_ids=pos, use_cache=False)
        oa, ob = model(a, use_cache=False), model(b, use_cache=False)
    assert torch.equal(out.iter_counts, torch.cat([oa.iter_counts, ob.iter_counts], 1))
    assert (out.logits - torch.cat([oa.logits, ob.logits], 1)).abs().max() <= 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# 7. Training-time behaviour: loss, gradients, checkpointing
# ---------------------------------------------------------------------------------------------------------------------


def test_loss_is_mixture_nll_and_decider_gets_gradient_only_via_continuing_tokens():
    model = tiny_tah2(max_iterations=2, decisive=False)
    model.train()
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(19))
    out = model(ids, labels=ids, return_mixture_logits=True)
    assert model(ids, labels=ids).logits is None  # training does not materialise the full mixture
    logq = out.logits[:, :-1]
    manual = -logq.gather(-1, ids[:, 1:, None]).mean()
    assert torch.allclose(out.loss, manual, atol=1e-5)
    out.loss.backward()
    grad = model.decider.score.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    # With nobody continuing, ω = 1 carries no g: the decider gets no gradient from the NTP loss.
    model.zero_grad()
    out = model(ids, labels=ids, exit_threshold=0.999)
    out.loss.backward()
    g = model.decider.score.weight.grad
    assert g is None or g.abs().sum() == 0


def test_gradient_checkpointing_on_equals_off():
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(20))

    def grads(checkpointing):
        model = script_decider(tiny_tah2(max_iterations=3, decisive=False), pattern_by_sign)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, ga = grads(False)
    loss_b, gb = grads(True)
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert ga.keys() == gb.keys() and any("layers.1.self_attn.k_proj" in n for n in ga)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-5), n


# ---------------------------------------------------------------------------------------------------------------------
# 8. Validation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_iterations", 0),
        ("exit_threshold", 0.0),
        ("exit_threshold", 1.5),
        ("iteration_attention", "bidirectional"),
        ("decider_topk", 0),
        ("mixture", "max"),
        ("updater", "mlp2"),
        ("decider", "sometimes"),
        ("decision_mode", "greedy"),
        ("updater_intermediate_size", -4),
    ],
)
def test_invalid_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TaH2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **{field: value})


def test_decider_topk_larger_than_vocab_is_zero_padded():
    model = tiny_tah2(max_iterations=2, decider_topk=150)  # vocabulary is 97
    probs = model.decider.topk_probs(torch.randn(3, 97))
    assert probs.shape == (3, 150)
    assert torch.all(probs[:, 97:] == 0) and torch.allclose(probs.sum(-1), torch.ones(3))
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 4)))


def test_convert_rejects_non_qwen3_sources(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="llama"):
        convert_qwen3(llama, "tah2")
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="llama"):
        convert_qwen3(str(tmp_path / "llama"), "tah2")
    with pytest.raises(ValueError, match="arch"):
        convert_qwen3(tiny_qwen3(), "transformer-xl")
    with pytest.raises(ValueError, match="not a local directory"):
        convert_qwen3(str(tmp_path / "missing"), "tah2")


def test_convert_from_directory_keeps_qwen3_weights(tmp_path):
    q = tiny_qwen3(tie_word_embeddings=True)
    q.save_pretrained(tmp_path / "q")
    model = convert_qwen3(str(tmp_path / "q"), "tah2", max_iterations=1).eval()
    assert isinstance(model, TaH2ForCausalLM) and model.config.model_type == "tah2"
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        assert (model(ids).logits - q(ids).logits).abs().max() <= 1e-5


def test_auto_classes_are_registered():
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model("tah2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_hidden_layers=1, intermediate_size=64, vocab_size=50)
    assert isinstance(cfg, TaH2Config)
    assert type(AutoModelForCausalLM.from_config(cfg)).__name__ == "TaH2ForCausalLM"
    assert type(AutoModel.from_config(cfg)).__name__ == "TaH2Model"


def test_base_model_is_one_qwen3_pass():
    q = tiny_qwen3()
    model = convert_qwen3(q, "tah2")
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        a = model.model(ids, max_iterations=1).last_hidden_state  # one pass on purpose (looped owner)
        b = q.model(ids).last_hidden_state
    assert (a - b).abs().max() <= 1e-5


def test_qwen3_reference_is_untouched_by_import():
    assert Qwen3ForCausalLM.__module__.startswith("transformers.")


def test_bf16_conversion_keeps_rope_in_fp32_and_matches_qwen3_bf16(tmp_path):
    q = tiny_qwen3()
    q.save_pretrained(tmp_path / "q")
    ref = Qwen3ForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    model = convert_qwen3(str(tmp_path / "q"), "tah2", dtype=torch.bfloat16, max_iterations=1)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


# ----------------------------------------------------------------------------------------------------------------------
# output_hidden_states / output_attentions (transformers conventions)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 2])
def test_output_hidden_states_match_qwen3_per_layer_and_give_every_depth(M):
    q = tiny_qwen3(0)
    m = convert_qwen3(q, "tah2", max_iterations=M).eval()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        ref = q(ids, attention_mask=mask, output_hidden_states=True)
        out = m(ids, attention_mask=mask, output_hidden_states=True)
        plain = m(ids, attention_mask=mask)
    assert len(out.hidden_states) == len(ref.hidden_states) == q.config.num_hidden_layers + 1
    for a, b in zip(out.hidden_states, ref.hidden_states, strict=False):
        torch.testing.assert_close(a, b)
    assert len(out.iteration_hidden_states) == int(out.iter_counts.max())
    assert plain.hidden_states is None and plain.iteration_hidden_states is None
    with torch.no_grad():
        base = m.model(ids, attention_mask=mask, output_hidden_states=True, max_iterations=1)
    for a, b in zip(base.hidden_states, ref.hidden_states, strict=False):
        torch.testing.assert_close(a, b)


def test_output_attentions_eager_returns_qwen3_weights_and_sdpa_raises():
    q = tiny_qwen3(0)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    m = convert_qwen3(q, "tah2", max_iterations=2).eval()
    with pytest.raises(ValueError, match="output_attentions=True needs attn_implementation='eager'"):
        m(ids, output_attentions=True)
    q.config._attn_implementation = "eager"
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = q(ids, output_attentions=True)
        out = m(ids, output_attentions=True)
    assert len(out.attentions) == q.config.num_hidden_layers
    for a, b in zip(out.attentions, ref.attentions, strict=False):
        torch.testing.assert_close(a, b)
