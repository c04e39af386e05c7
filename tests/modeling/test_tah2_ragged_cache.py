"""TaH2's ragged deeper streams: the persistent cache stores a token's K/V only for the depths it ran, at any batch
size (no placeholder columns), and decoding through it equals the full forward and the row-padded layout."""

import random

import pytest
import torch
from helpers.sync_helpers import spy_syncs
from helpers.tah2_helpers import left_padded_batch, pattern_by_hidden, pattern_by_sign, script_decider, tiny_tah2

from hf_loops.modeling.cache_tah2 import TaH2Cache


def _constant(p):
    return lambda embeds, hidden=None: torch.full(embeds.shape[:-1], p)


DECIDERS = {"all-stop": _constant(0.1), "all-continue": _constant(0.9), "by-sign": pattern_by_sign,
            "by-hidden": pattern_by_hidden}


@torch.no_grad()
def _decode_teacher_forced(model, ids, mask, prefill):
    """Prefill `prefill` columns, then feed the remaining columns one at a time through the cache."""
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    logits, depths, cache = [out.logits], [out.iter_counts], out.cache
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
        depths.append(out.iter_counts)
    return torch.cat(logits, 1), torch.cat(depths, 1), cache


def _padded_layout(monkeypatch):
    monkeypatch.setattr(TaH2Cache, "is_ragged", lambda self, stream: False)


def _kv_bytes_formula(model, depth_of_cached_tokens, batch, length):
    """Stream 0 holds every column of every row (padding included, like Qwen3's cache); a real token adds one entry
    per extra depth it ran. Per entry and layer: K and V of H_kv heads × head_dim, fp32."""
    cfg = model.config
    per_entry = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers
    extra = int((depth_of_cached_tokens - 1).clamp(min=0).sum())
    return per_entry * (batch * length + extra)


def test_kv_bytes_equal_the_formula_for_a_known_depth_pattern():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_sign)
    ids, mask = left_padded_batch([9, 4, 7], seed=1)
    _, depths, cache = _decode_teacher_forced(model, ids, mask, prefill=5)
    depths = depths * mask  # padding never runs
    assert cache.kv_bytes() == _kv_bytes_formula(model, depths, 3, 9)
    assert depths.max() == 3 and int((depths == 1).sum()) > 0  # the pattern mixes depths
    for stream in (1, 2):  # flat: one batch row holding exactly the entries of tokens that ran this depth
        keys = cache.layers[cache.kv_slot(stream, 0)].keys
        assert keys.shape[0] == 1 and keys.shape[2] == int((depths > stream).sum())


def test_padded_layout_stores_placeholders_that_the_ragged_one_does_not(monkeypatch):
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_hidden)
    ids, mask = left_padded_batch([10, 10, 10, 10], seed=2)
    _, depths, ragged = _decode_teacher_forced(model, ids, mask, prefill=3)
    ragged_bytes = ragged.kv_bytes()
    _padded_layout(monkeypatch)
    _, depths_padded, padded = _decode_teacher_forced(model, ids, mask, prefill=3)
    assert torch.equal(depths, depths_padded)
    assert ragged_bytes == _kv_bytes_formula(model, depths, 4, 10)
    assert padded.kv_bytes() > ragged_bytes


def _sweep_cases(n):
    rng = random.Random(1234)
    for _ in range(n):
        batch = rng.randint(1, 4)
        width = rng.randint(3, 10)
        lengths = [rng.randint(1, width) for _ in range(batch)]
        lengths[rng.randrange(batch)] = width
        yield dict(M=rng.choice([2, 3, 4]), mode=rng.choice(["duo", "same_iter", "causal"]),
                   decider=rng.choice(list(DECIDERS)), lengths=lengths, prefill=rng.randint(1, width),
                   seed=rng.randrange(1000))


@pytest.mark.parametrize("case", list(_sweep_cases(24)), ids=lambda c: f"M{c['M']}-{c['mode']}-{c['decider']}-"
                         f"{'x'.join(map(str, c['lengths']))}-p{c['prefill']}")
def test_ragged_cache_equals_full_forward_and_padded_layout(case, monkeypatch):
    model = script_decider(tiny_tah2(seed=case["seed"] % 7, max_iterations=case["M"], iteration_attention=case["mode"]),
                           DECIDERS[case["decider"]])
    ids, mask = left_padded_batch(case["lengths"], seed=case["seed"])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False)
    logits, depths, cache = _decode_teacher_forced(model, ids, mask, case["prefill"])
    real = mask.bool()
    assert torch.equal(depths * mask, full.iter_counts * mask)
    assert (logits - full.logits)[real].abs().max() <= 1e-5
    B, S = ids.shape
    if case["mode"] != "causal":  # causal mode keeps no deeper stream
        assert cache.kv_bytes() == _kv_bytes_formula(model, full.iter_counts * mask, B, S)
    _padded_layout(monkeypatch)
    logits_padded, depths_padded, _ = _decode_teacher_forced(model, ids, mask, case["prefill"])
    assert torch.equal(depths_padded, depths)
    assert (logits_padded - logits)[real].abs().max() <= 1e-5


@pytest.mark.parametrize("decider", ["by-sign", "by-hidden"])
def test_beam_search_and_return_sequences_move_ragged_streams(decider):
    model = script_decider(tiny_tah2(max_iterations=3), DECIDERS[decider])
    ids, mask = left_padded_batch([6, 3], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    with torch.no_grad():
        for extra in (dict(num_beams=3, do_sample=False), dict(num_beams=2, num_return_sequences=2, do_sample=False)):
            a = model.generate(ids, use_cache=True, **kw, **extra)
            b = model.generate(ids, use_cache=False, **kw, **extra)
            assert torch.equal(a, b), extra


def test_select_rows_and_crop_keep_each_rows_entries():
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_hidden)
    ids, mask = left_padded_batch([8, 5, 8], seed=4)
    _, _, cache = _decode_teacher_forced(model, ids, mask, prefill=8)
    before = cache.stream_metadata(1)
    keys = cache.layers[cache.kv_slot(1, 1)].keys
    per_row = [keys[0, :, before["gather"][r][before["valid"][r]]] for r in range(3)]
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    after = cache.stream_metadata(1)
    keys = cache.layers[cache.kv_slot(1, 1)].keys
    for new_row, old_row in enumerate([2, 2, 0]):
        assert torch.equal(after["index"][new_row][after["valid"][new_row]],
                           before["index"][old_row][before["valid"][old_row]])
        assert torch.equal(keys[0, :, after["gather"][new_row][after["valid"][new_row]]], per_row[old_row])
    cache.crop(-3)
    cropped = cache.stream_metadata(1)
    assert cache.get_seq_length() == 5
    assert int(cropped["index"][cropped["valid"]].max()) < 5
    assert cache.layers[cache.kv_slot(1, 0)].keys.shape[2] == int(cropped["valid"].sum())


@pytest.mark.parametrize("M", [2, 3])
def test_decode_step_reads_the_device_once_per_depth_boundary(monkeypatch, M):
    """Python-visible host syncs (item, tolist, bool(), int(), nonzero, boolean indexing, ...) made by hf_loops code
    in a decode step: exactly one `tolist` of the continue decisions per depth boundary that runs (HF's own mask
    builder, shared with Standard, is not counted)."""
    model = script_decider(tiny_tah2(max_iterations=M), pattern_by_hidden)
    ids, mask = left_padded_batch([9, 6, 11, 11], seed=5)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
    syncs = []
    step_ids = torch.randint(3, 97, (4, 6), generator=torch.Generator().manual_seed(6))
    depths = []
    spy_syncs(monkeypatch, lambda name: syncs[-1].append(name), only_from="hf_loops")
    with torch.no_grad():
        for t in range(6):
            syncs.append([])
            mask = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], 1)
            out = model(step_ids[:, t:t + 1], attention_mask=mask, cache=cache, use_cache=True)
            depths.append(out.iter_counts[:, 0])
    monkeypatch.undo()
    for step, d in zip(syncs, depths, strict=False):
        boundaries = min(int(d.max()), M - 1)  # a boundary runs when some token reached it and could continue
        assert step == ["tolist"] * boundaries, (step, d.tolist())
    assert any(int(d.max()) > 1 for d in depths) and any(int(d.min()) == 1 for d in depths)
