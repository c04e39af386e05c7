"""Continuous-depth decoding (`generate` on TaH2): one pass of the layer stack per step over mixed depths gives the
same tokens and per-token depths as lockstep decoding (`continuous_depth=False`) and as each row decoded alone."""

import random

import pytest
import torch
from helpers.sync_helpers import spy_syncs
from helpers.tah2_helpers import left_padded_batch, pattern_by_hidden, pattern_by_sign, script_decider, tiny_tah2
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_loops.core.compat import cache_of


def _constant(p):
    return lambda embeds, hidden=None: torch.full(embeds.shape[:-1], p)


DECIDERS = {"all-stop": _constant(0.1), "all-continue": _constant(0.9), "by-sign": pattern_by_sign,
            "by-hidden": pattern_by_hidden, "learned": None}


def _model(seed, M, mode, decider, **kw):
    model = tiny_tah2(seed=seed, max_iterations=M, iteration_attention=mode, **kw)
    model.generation_config.eos_token_id = None  # each test says which EOS it decodes with
    return model if DECIDERS[decider] is None else script_decider(model, DECIDERS[decider])


@torch.no_grad()
def _lockstep(model, ids, mask, **kw):
    """Lockstep tokens and the executed depth of every decoded input token (from the returned cache)."""
    out = model.generate(ids, attention_mask=mask, continuous_depth=False, return_dict_in_generate=True, **kw)
    assert model._last_decode_mode == "lockstep"
    P = ids.shape[1]
    return out.sequences, cache_of(out).token_depth[:, P:]


@torch.no_grad()
def _continuous(model, ids, mask, **kw):
    # sampled calls at batch > 1 stay on lockstep unless asked (a seed keeps lockstep's draws); greedy ones need not ask
    if kw.get("do_sample") and ids.shape[0] > 1:
        kw.setdefault("continuous_depth", True)
    seq = model.generate(ids, attention_mask=mask, **kw)
    assert model._last_decode_mode == "continuous_depth"
    return seq, model._last_decode_depths


def _stop_index(row_new, eos):
    """Number of new tokens up to and including the first EOS (all when none)."""
    if eos is None:
        return row_new.numel()
    hits = (row_new == eos).nonzero()
    return int(hits[0]) + 1 if hits.numel() else row_new.numel()


def _assert_same_as_lockstep(model, ids, mask, eos, strict=True, **kw):
    """Same sequences and per-token depths as lockstep. `strict`: the only stop is EOS / length, so every row has one
    depth per decoded input token up to its EOS (custom criteria stop rows earlier)."""
    seq, depths = _continuous(model, ids, mask, eos_token_id=eos, **kw)
    ref, ref_depths = _lockstep(model, ids, mask, eos_token_id=eos, **kw)
    assert torch.equal(seq, ref), (seq, ref)
    P = ids.shape[1]
    for r in range(ids.shape[0]):
        n = _stop_index(seq[r, P:], eos)
        assert len(depths[r]) == n - 1 if strict else len(depths[r]) <= n - 1
        assert depths[r] == ref_depths[r, : len(depths[r])].tolist(), (r, depths[r], ref_depths[r])
    return seq, depths


def _sweep_cases(n):
    rng = random.Random(2023)
    for _ in range(n):
        batch = rng.randint(1, 8)
        width = rng.randint(2, 9)
        lengths = [rng.randint(1, width) for _ in range(batch)]
        lengths[rng.randrange(batch)] = width
        yield dict(M=rng.choice([2, 3, 4]), mode=rng.choice(["duo", "causal", "same_iter"]),
                   decider=rng.choice(list(DECIDERS)), lengths=lengths, new=rng.randint(2, 10),
                   eos=rng.random() < 0.5, seed=rng.randrange(1000))


@pytest.mark.parametrize("case", list(_sweep_cases(30)), ids=lambda c: f"M{c['M']}-{c['mode']}-{c['decider']}-"
                         f"{'x'.join(map(str, c['lengths']))}-n{c['new']}{'-eos' if c['eos'] else ''}")
@pytest.mark.slow
def test_greedy_equals_lockstep_and_rows_alone(case):
    model = _model(case["seed"] % 7, case["M"], case["mode"], case["decider"])
    ids, mask = left_padded_batch(case["lengths"], seed=case["seed"])
    kw = dict(max_new_tokens=case["new"], do_sample=False, pad_token_id=0)
    eos = None
    if case["eos"]:  # an EOS that some row emits mid-way: that row stops and gets padding, the others go on
        probe, _ = _continuous(model, ids, mask, eos_token_id=None, **kw)
        eos = int(probe[0, ids.shape[1] + case["new"] // 2])
    seq, depths = _assert_same_as_lockstep(model, ids, mask, eos, **kw)
    P = ids.shape[1]
    for r, n in enumerate(case["lengths"]):  # each row decoded alone, without padding
        alone, alone_depths = _continuous(model, ids[r:r + 1, P - n:], mask[r:r + 1, P - n:], eos_token_id=eos, **kw)
        k = alone.shape[1] - n
        assert torch.equal(alone[0, n:], seq[r, P:P + k])
        assert (seq[r, P + k:] == 0).all()
        assert alone_depths[0] == depths[r][: len(alone_depths[0])]
    if eos is not None:
        assert (seq[0, P:] == eos).any()


def test_depths_really_mix_and_steps_are_fewer_than_lockstep_passes():
    """A pattern where rows disagree: the loop runs fewer passes than lockstep's (one per depth that any row runs)."""
    model = _model(1, 3, "duo", "by-hidden")
    ids, mask = left_padded_batch([6, 6, 4, 5], seed=11)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    seq, depths = _assert_same_as_lockstep(model, ids, mask, None, **kw)
    flat = [d for row in depths for d in row]
    assert 1 in flat and max(flat) >= 2
    lockstep_passes = sum(max(row[t] for row in depths) for t in range(len(depths[0])))
    assert model._last_decode_steps < lockstep_passes
    assert model._last_decode_steps == max(sum(row) for row in depths)


@pytest.mark.parametrize("extra", [
    dict(repetition_penalty=1.5),
    dict(no_repeat_ngram_size=2),
    dict(min_new_tokens=5, bad_words_ids=[[7], [9, 10]]),
    dict(do_sample=True, top_k=1),  # deterministic sampling: equal to greedy
    dict(do_sample=True, top_k=1, num_return_sequences=3),
])
@pytest.mark.slow
def test_logits_processors_and_return_sequences_equal_lockstep(extra):
    model = _model(2, 3, "duo", "by-sign")
    ids, mask = left_padded_batch([5, 3], seed=4)
    kw = dict(max_new_tokens=9, pad_token_id=0, **({"do_sample": False} | extra))
    torch.manual_seed(0)
    seq, depths = _assert_same_as_lockstep(model, ids, mask, 1, **kw)
    if extra.get("num_return_sequences"):
        assert seq.shape[0] == 6 and torch.equal(seq[0], seq[2]) and torch.equal(seq[3], seq[5])


class _StopOnMultipleOf(StoppingCriteria):
    """Row-wise custom criterion: stop when the last token is a multiple of k."""

    def __init__(self, k):
        self.k = k

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % self.k == 0


@pytest.mark.parametrize("eos", [None, 1])
def test_custom_stopping_criteria_with_and_without_eos(eos):
    """Without EOS criteria lockstep keeps generating real tokens for stopped rows until every row stops; with them
    stopped rows get padding. Both behaviours are reproduced."""
    model = _model(3, 2, "duo", "by-hidden")
    ids, mask = left_padded_batch([4, 6, 2, 5], seed=8)
    kw = dict(max_new_tokens=15, do_sample=False, pad_token_id=0,
              stopping_criteria=StoppingCriteriaList([_StopOnMultipleOf(5)]))
    seq, _ = _assert_same_as_lockstep(model, ids, mask, eos, strict=False, **kw)
    assert seq.shape[1] - ids.shape[1] < 15  # the criterion fired before the length limit


@pytest.mark.parametrize("mode", ["duo", "same_iter"])
def test_sampling_draws_from_the_mixture_of_the_teacher_forced_forward(mode, monkeypatch):
    """Sampling at batch > 1: every distribution a token is drawn from equals the teacher-forced forward's log q at
    that prefix (the random draws themselves differ from lockstep's, whose rows draw together)."""
    from hf_loops.modeling import generation_tah2

    model = _model(4, 3, mode, "by-hidden")
    ids, mask = left_padded_batch([5, 5, 3], seed=9)
    drawn = []  # (rows, the scores they were drawn from), in the loop's order; a row's k-th draw is its token k + 1
    original = generation_tah2._Stopping.scores

    def recording(self, ids_, rows_t, slots_t, count, log_q):
        out = original(self, ids_, rows_t, slots_t, count, log_q)
        drawn.append((rows_t.tolist(), out.clone()))
        return out

    monkeypatch.setattr(generation_tah2._Stopping, "scores", recording)
    torch.manual_seed(0)
    seq, _ = _continuous(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=97, pad_token_id=0)
    monkeypatch.undo()
    P = ids.shape[1]
    pad = torch.cat([mask, torch.ones(3, seq.shape[1] - P, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(seq, attention_mask=pad, use_cache=False).logits
    seen = [0, 0, 0]
    for rows, scores in drawn:
        for i, r in enumerate(rows):
            k = seen[r]
            seen[r] += 1
            assert torch.allclose(scores[i], full[r, P + k], atol=1e-4), (r, k)
            assert torch.isfinite(scores[i, seq[r, P + k + 1]])
    assert seen == [7, 7, 7]


def test_sampling_at_batch_one_equals_lockstep_with_the_same_seed():
    """One row draws one token per call in both loops, so the same seed gives the same tokens."""
    model = _model(5, 3, "duo", "learned")
    ids, mask = left_padded_batch([6], seed=10)
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, pad_token_id=0)
    torch.manual_seed(7)
    seq, depths = _continuous(model, ids, mask, **kw)
    torch.manual_seed(7)
    ref, ref_depths = _lockstep(model, ids, mask, **kw)
    assert torch.equal(seq, ref)
    assert depths[0] == ref_depths[0, : len(depths[0])].tolist()


class _Collect(BaseStreamer):
    def __init__(self):
        self.values, self.ended = [], False

    def put(self, value):
        self.values.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_batch_one_streams_the_same_tokens():
    model = _model(6, 2, "duo", "by-hidden")
    ids, mask = left_padded_batch([5], seed=12)
    a, b = _Collect(), _Collect()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, streamer=a)
        assert model._last_decode_mode == "continuous_depth"
        model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, streamer=b, continuous_depth=False)
    assert a.values == b.values and a.ended and b.ended


def test_eager_attention_and_even_mixture():
    model = _model(0, 3, "duo", "by-hidden", mixture="even")
    model.config._attn_implementation = "eager"
    ids, mask = left_padded_batch([4, 7, 2], seed=13)
    _assert_same_as_lockstep(model, ids, mask, None, max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("eos", [False, True])
def test_rows_that_are_done_leave_the_pass(eos):
    """The pass runs only the rows still computing: without EOS every row runs exactly one query per executed depth of
    its decoded tokens (Σ depth queries, none idle in the tail while the deepest row finishes); with an EOS, a stopped
    row runs at most one more (the step in which its stop is read) and then none."""
    model = _model(1, 3, "duo", "by-hidden")
    ids, mask = left_padded_batch([6, 6, 4, 5], seed=11)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    stop = None
    if eos:
        probe, _ = _continuous(model, ids, mask, eos_token_id=None, **kw)
        stop = int(probe[1, ids.shape[1] + 4])
    seq, depths = _assert_same_as_lockstep(model, ids, mask, stop, **kw)
    queries = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda mod, args: queries.append(args[0].shape[0]))
    try:
        _continuous(model, ids, mask, eos_token_id=stop, **kw)
    finally:
        hook.remove()
    decode = queries[-model._last_decode_steps:]  # before them: the prefill cascade's passes
    sums = [sum(row) for row in depths]
    assert len(set(sums)) > 1  # rows finish at different steps, so some steps run fewer rows
    assert min(decode) < ids.shape[0]
    if eos:
        stopped = sum(1 for r in range(ids.shape[0]) if (seq[r, ids.shape[1]:] == stop).any())
        assert sum(sums) <= sum(decode) <= sum(sums) + stopped
    else:
        assert sum(decode) == sum(sums)


@pytest.mark.parametrize("M", [2, 4])
def test_one_host_read_per_step(monkeypatch, M):
    """hf_loops code reads the device once per step (the continue and stop flags together), beyond the prefill."""
    model = _model(1, M, "duo", "by-hidden")
    ids, mask = left_padded_batch([6, 3, 6], seed=14)
    syncs, loop_syncs = [], []
    spy_syncs(monkeypatch, syncs.append, only_from="hf_loops")
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        prefill = len(syncs)
        del syncs[:]
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    monkeypatch.undo()
    steps = model._last_decode_steps
    assert steps > 10
    assert len(syncs) <= prefill + steps, (len(syncs), prefill, steps, syncs)
    spy_syncs(monkeypatch, loop_syncs.append, only_from="generation_tah2")
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    monkeypatch.undo()
    assert loop_syncs == ["tolist"] * model._last_decode_steps


def test_lockstep_paths_and_the_switch():
    model = _model(2, 2, "duo", "by-sign")
    ids, mask = left_padded_batch([4, 4], seed=15)
    kw = dict(attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, num_beams=2, do_sample=False, **kw)
        assert model._last_decode_mode == "lockstep"
        model.generate(ids, do_sample=False, use_cache=False, **kw)
        assert model._last_decode_mode == "lockstep"
        model.continuous_depth_decoding = False
        model.generate(ids, do_sample=False, **kw)
        assert model._last_decode_mode == "lockstep"
        model.generate(ids, do_sample=False, continuous_depth=True, **kw)
        assert model._last_decode_mode == "continuous_depth"
        model.continuous_depth_decoding = True
        with pytest.raises(ValueError, match="continuous_depth"):
            model.generate(ids, do_sample=False, continuous_depth="yes", **kw)


@pytest.mark.parametrize("variant", [
    dict(updater="topk_embedding", updater_topk=5),
    dict(updater="hidden", mixture="final"),
    dict(updater="identity", iteration_attention="same_iter"),
])
def test_updater_and_mixture_variants(variant):
    mode = variant.pop("iteration_attention", "duo")
    model = _model(3, 3, mode, "by-hidden", **variant)
    ids, mask = left_padded_batch([5, 2, 4], seed=16)
    _assert_same_as_lockstep(model, ids, mask, None, max_new_tokens=7, do_sample=False, pad_token_id=0)


def test_per_call_loop_knobs_and_inputs_embeds():
    model = _model(4, 4, "duo", "learned")
    ids, mask = left_padded_batch([6, 4], seed=17)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    _assert_same_as_lockstep(model, ids, mask, None, max_iterations=3, exit_threshold=0.3, **kw)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        a = model.generate(inputs_embeds=embeds, attention_mask=mask, **kw)
        assert model._last_decode_mode == "continuous_depth"
        b = model.generate(inputs_embeds=embeds, attention_mask=mask, continuous_depth=False, **kw)
    assert torch.equal(a, b) and a.shape == (2, 8)


@pytest.mark.slow
def test_kv_buffer_grows_past_its_first_reserve():
    model = _model(5, 2, "duo", "all-continue")
    ids, mask = left_padded_batch([3], seed=18)
    kw = dict(max_new_tokens=140, do_sample=False, pad_token_id=0)
    seq, depths = _assert_same_as_lockstep(model, ids, mask, None, **kw)
    assert model._last_decode_steps == 2 * 139 > 256


def test_sampling_at_batch_above_one_stays_on_lockstep_unless_asked():
    """Rows draw at different steps under continuous depth, so by default a sampled batch keeps lockstep's draws: the
    same seed gives the same tokens with and without cache. `continuous_depth=True` opts in."""
    model = _model(2, 3, "duo", "learned")
    ids, mask = left_padded_batch([5, 3], seed=4)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.9, pad_token_id=0)
    torch.manual_seed(3)
    cached = model.generate(ids, attention_mask=mask, **kw)
    assert model._last_decode_mode == "lockstep"
    torch.manual_seed(3)
    assert torch.equal(cached, model.generate(ids, attention_mask=mask, use_cache=False, **kw))
    model.generate(ids, attention_mask=mask, continuous_depth=True, **kw)
    assert model._last_decode_mode == "continuous_depth"
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert model._last_decode_mode == "continuous_depth"
