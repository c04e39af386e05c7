"""SpiralFormer row-selective batched decoding, ragged core cache and attention backends (issue 14).

Equality only, no timing: row-selective decode == full no-cache forward, cache == no-cache generate (greedy, beams,
returned sequences), batch repeat/select/reorder, exact core-row pass counts, cache bytes == formula (no placeholder
columns), one host sync per decode step, eager == sdpa == flex_attention.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.flex import uncompiled_flex
from helpers.sync_helpers import spy_syncs
from test_spiralformer import VOCAB, make_config, make_model
from transformers import DynamicCache

from hf_loops import SpiralFormerForCausalLM
from hf_loops.modeling import modeling_spiralformer as msf


def left_padded(lengths, width=None, seed=0):
    """A batch of random rows (ids ≥ 2) left-padded with 0 to `width`, and its 2-D attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for r, n in enumerate(lengths):
        ids[r, : width - n] = 0
        mask[r, : width - n] = 0
    return ids, mask


def decode_logits(model, ids, mask, n0, cache=None):
    """Prefill the first n0 columns, then feed the remaining columns one at a time (teacher forcing)."""
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        outs = [model(ids[:, :n0], attention_mask=mask[:, :n0], cache=cache, use_cache=True).logits]
        for i in range(n0, ids.shape[1]):
            outs.append(model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(outs, 1), cache


def max_real_diff(a, b, mask):
    return ((a - b).abs().amax(-1) * mask).max().item()


# ----------------------------------------------------------------------------------------------------------------------
# row-selective decode == dense / no-cache forward
# ----------------------------------------------------------------------------------------------------------------------

SCHEDULES = [
    dict(chunk_sizes=[8, 4, 2, 1]),
    dict(chunk_sizes=[4, 2, 1], topology="anchor", shift="no_overlap", shift_frame="padded"),
    dict(chunk_sizes=[6, 3, 1], chunk_offset="zero", downscale="mean", upscale="uniform", core_output="delta"),
    dict(chunk_sizes=[16, 8, 4, 2], latent_positions="last_token", num_hidden_layers=4, num_loop_layers=2),
]


@pytest.mark.parametrize("overrides", SCHEDULES, ids=lambda o: "-".join(map(str, o["chunk_sizes"])))
@pytest.mark.slow
def test_row_selective_decode_equals_full_forward_sweep(overrides):
    model = make_model(**overrides)
    rng = random.Random(sum(overrides["chunk_sizes"]))
    g_max = overrides["chunk_sizes"][0]
    for case in range(4):
        b = case + 1
        # prompt lengths around chunk boundaries (k·g − 1, k·g, k·g + 1, …), different left padding per row
        prompt = [max(1, rng.choice([g_max - 1, g_max, g_max + 1, 2 * g_max - 1, 3, 1]) + rng.randint(0, 2))
                  for _ in range(b)]
        n0 = max(prompt)
        new = rng.randint(g_max, 2 * g_max + 3)
        lengths = [n + new for n in prompt]
        ids, mask = left_padded(lengths, n0 + new, seed=case)
        with torch.no_grad():
            full = model(ids, attention_mask=mask, use_cache=False).logits
        inc, cache = decode_logits(model, ids, mask, n0)
        assert max_real_diff(inc, full, mask) < 2e-5, (overrides, prompt, new)
        assert cache.get_seq_length() == ids.shape[1]


@pytest.mark.slow
def test_generate_greedy_beams_and_returned_sequences_with_cache_equal_without():
    model = make_model(chunk_sizes=[8, 4, 2, 1])
    ids, mask = left_padded([6, 11, 3, 9], seed=3)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for extra in (dict(max_new_tokens=19), dict(max_new_tokens=9, num_beams=2),
                      dict(max_new_tokens=9, num_beams=2, num_return_sequences=2)):
            with_cache = model.generate(ids, **kw, **extra)
            without = model.generate(ids, **kw, **extra, use_cache=False)
            assert torch.equal(with_cache, without), extra


def test_batch_repeat_interleave_select_and_reorder_move_the_ragged_cache():
    model = make_model(chunk_sizes=[4, 2, 1])
    ids, mask = left_padded([7, 4], width=7, seed=5)
    more = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    rep_ids, rep_mask, rep_more = (x.repeat_interleave(2, dim=0) for x in (ids, mask, more))

    def run(cache, ids_, mask_, more_):
        out = []
        with torch.no_grad():
            for i in range(more_.shape[1]):
                mask_ = torch.cat([mask_, torch.ones_like(mask_[:, :1])], 1)
                out.append(model(more_[:, i : i + 1], attention_mask=mask_, cache=cache, use_cache=True).logits)
        return torch.cat(out, 1)

    with torch.no_grad():
        ref_cache = DynamicCache()
        model(rep_ids, attention_mask=rep_mask, cache=ref_cache, use_cache=True)
        ref = run(ref_cache, rep_ids, rep_mask, rep_more)
        cache = DynamicCache()
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        cache.batch_repeat_interleave(2)
        assert (run(cache, rep_ids, rep_mask, rep_more) - ref).abs().max() < 1e-5
        for op, sel in (("select", torch.tensor([3, 0])), ("reorder", torch.tensor([2, 2, 1, 0]))):
            cache = DynamicCache()
            model(rep_ids, attention_mask=rep_mask, cache=cache, use_cache=True)
            cache.batch_select_indices(sel) if op == "select" else cache.reorder_cache(sel)
            got = run(cache, rep_ids[sel], rep_mask[sel], rep_more[sel])
            assert (got - ref[sel]).abs().max() < 1e-5, op


# ----------------------------------------------------------------------------------------------------------------------
# core passes, cache bytes, host syncs
# ----------------------------------------------------------------------------------------------------------------------


class CoreRowCounter:
    """Counts the rows the first core layer runs on (hidden.shape[0] per call), as the benchmark does."""

    def __init__(self, model):
        self.rows = 0
        self.counting = lambda: True
        self.handle = model.model.core_layers[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if self.counting():
            self.rows += (args[0] if args else kwargs["hidden_states"]).shape[0]


def test_core_runs_only_on_triggering_rows_exact_count():
    # chunk sizes 8/4/2/1 with ω = 4/2/1/0 fire at position p when: g=8 p ≡ 3 (mod 8), g=4 p ≡ 1 (mod 4),
    # g=2 p even, g=1 always. Rows of 5, 8, 3 prompt tokens decode positions 5..9, 8..12, 3..7:
    #   row 0 (5..9):  g8 –, g4 {5, 9}, g2 {6, 8},     g1 ×5  → 9
    #   row 1 (8..12): g8 {11}, g4 {9}, g2 {8, 10, 12}, g1 ×5 → 10
    #   row 2 (3..7):  g8 {3}, g4 {5}, g2 {4, 6},       g1 ×5 → 9
    # = 28 core rows (per level 2 / 4 / 7 / 15). Running every row whenever any row fires would cost 48.
    model = make_model(chunk_sizes=[8, 4, 2, 1])
    prompt, new = [5, 8, 3], 5
    ids, mask = left_padded([n + new for n in prompt], max(prompt) + new, seed=1)
    cache = DynamicCache()
    per_level = {8: 0, 4: 0, 2: 0, 1: 0}
    orig = model.model._core

    def spy(t, z, *args, **kwargs):
        per_level[model.config.chunk_sizes[t]] += z.shape[0]
        return orig(t, z, *args, **kwargs)

    with torch.no_grad():
        n0 = max(prompt)
        model(ids[:, :n0], attention_mask=mask[:, :n0], cache=cache, use_cache=True)
        counter = CoreRowCounter(model)
        model.model._core = spy
        try:
            for i in range(n0, n0 + new):
                model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache, use_cache=True)
        finally:
            model.model._core = orig
            counter.handle.remove()
    assert counter.rows == 28
    assert per_level == {8: 2, 4: 4, 2: 7, 1: 15}


def test_core_passes_per_decode_token_on_a_long_mixed_batch():
    model = make_model(chunk_sizes=[8, 4, 2, 1])
    lengths = [20 - 3 * i for i in range(6)]  # 3·i mod 8 differs per row: the rows never fire together
    ids, mask = left_padded(lengths, seed=2)
    calls, new = [0], 40
    pre = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    counter = CoreRowCounter(model)
    counter.counting = lambda: calls[0] > 1  # call 1 is the prefill
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    finally:
        pre.remove()
        counter.handle.remove()
    per_token = counter.rows / (len(lengths) * (calls[0] - 1))
    assert calls[0] - 1 == new - 1
    assert per_token <= 1.9, per_token
    assert per_token == pytest.approx(1.875, abs=0.03)  # Σ 1/g_t; 39 steps are not a multiple of 8


def test_core_cache_holds_no_placeholder_columns():
    model = make_model(chunk_sizes=[8, 4, 2, 1], num_hidden_layers=4, num_pre_layers=1, num_loop_layers=2)
    cfg, layout = model.config, model.model.layout
    prompt, new = [5, 13, 9, 2], 6
    width = max(prompt)
    ids, mask = left_padded([n + new for n in prompt], width + new, seed=4)
    _, cache = decode_logits(model, ids, mask, width)
    col = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K + V bytes of one column, fp32
    omegas = [g // 2 for g in cfg.chunk_sizes]
    for t, (g, w) in enumerate(zip(cfg.chunk_sizes, omegas, strict=False)):
        expected = [(n + new + w) // g for n in prompt]  # closed chunks of each row's own tokens
        for l in range(cfg.num_loop_layers):
            assert cache.layers[layout.core_slot(t, l)].row_lengths() == expected, (t, l)
    core_cols = cfg.num_loop_layers * sum((n + new + w) // g for n in prompt for g, w in zip(cfg.chunk_sizes, omegas, strict=False))
    got = model.model.cache_bytes(cache)
    assert got["core"] == col * core_cols  # 2 · n_kv · d_head · 4 · N_loop · Σ_rows Σ_t ⌊(n_r + ω_t)/g_t⌋
    assert got["tokens"] == col * (cfg.num_pre_layers + cfg.num_post_layers) * len(prompt) * (width + new)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_decode_step_makes_one_host_sync(monkeypatch, impl):
    """Python-visible syncs (item, tolist, bool(), int(), nonzero, boolean indexing, …) in three decode steps."""
    model = make_model(chunk_sizes=[8, 4, 2, 1], attn_implementation=impl)
    ids, mask = left_padded([9, 6, 11], seed=7)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    syncs = []
    spy_syncs(monkeypatch, syncs.append)
    step_ids = torch.randint(2, VOCAB, (3, 1))
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        for _ in range(3):  # positions fire different levels on different rows
            model(step_ids, attention_mask=step_mask, cache=cache, use_cache=True)
            step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    monkeypatch.undo()
    assert syncs == ["tolist"] * 3, syncs


# ----------------------------------------------------------------------------------------------------------------------
# attention backends
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sdpa_and_flex_attention_match_eager_prefill_and_decode(monkeypatch):
    uncompiled_flex(monkeypatch)  # the masks under test are the BlockMasks (see helpers.flex)
    model = make_model(chunk_sizes=[4, 2, 1])
    ids, mask = left_padded([14, 9, 5], seed=8)
    aligned = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
    results = {}
    with torch.no_grad():
        for impl in ("eager", "sdpa", "flex_attention"):
            model.set_attn_implementation(impl)
            assert model.config._attn_implementation == impl
            results[impl] = (model(ids, attention_mask=mask).logits, decode_logits(model, ids, mask, 8)[0],
                             model(aligned).logits, decode_logits(model, aligned, torch.ones_like(aligned), 3)[0])
    for impl in ("sdpa", "flex_attention"):
        for k, (got, ref) in enumerate(zip(results[impl], results["eager"], strict=False)):
            m = mask if k < 2 else torch.ones_like(aligned)
            assert max_real_diff(got, ref, m) < 1e-5, (impl, k)


def test_flex_attention_builds_block_masks_once_per_call(monkeypatch):
    uncompiled_flex(monkeypatch)  # the masks under test are the BlockMasks (see helpers.flex)
    from torch.nn.attention import flex_attention as torch_flex

    built = []
    real = torch_flex.create_block_mask
    monkeypatch.setattr(torch_flex, "create_block_mask", lambda *a, **k: built.append(k["Q_LEN"]) or real(*a, **k))
    model = make_model(chunk_sizes=[4, 2, 1], num_hidden_layers=6, num_pre_layers=2, num_loop_layers=2,
                       num_post_layers=2, attn_implementation="flex_attention")
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        model(ids)
    # one token mask shared by the 4 pre/post layers, one latent mask per level shared by the 2 core layers
    assert built == [9, (9 + 2) // 4, (9 + 1) // 2, 9]


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_is_refused_with_a_clear_error(impl):
    with pytest.raises(ValueError, match=r"attn_implementation.*'eager', 'sdpa', 'flex_attention'"):
        SpiralFormerForCausalLM(make_config(attn_implementation=impl))
    model = make_model()
    with pytest.raises(ValueError, match="attn_implementation"):
        model.set_attn_implementation(impl)
    model.config._attn_implementation = "paged|eager"  # e.g. set behind the model's back
    with pytest.raises(ValueError, match=r"SpiralFormer supports attn_implementation"):
        model(torch.randint(2, VOCAB, (1, 4)))
    assert msf.SpiralFormerPreTrainedModel._supports_flex_attn
