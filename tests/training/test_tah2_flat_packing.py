"""Flat (varlen) packing of TaH2's deeper depths in training: one (1, N) row of every row's active tokens, instead of
per-row right padding. The values must not change: a seeded sweep runs each case twice in float64, flat and per-row
(`deeper_packing = "per_row"`, the previous layout), and compares the loss, every gradient, the per-depth losses,
the lookahead losses, the depth labels and every logged metric."""

import random

import pytest
import torch
from helpers.tah2_helpers import tiny_tah2
from helpers.tah2_sweep import DECIDERS, PADDINGS, ArgsNS, install_decider, make_batch, run_case

from hf_loops.training.tah2_trainer import metric_values

MODELS = {}


def _model(M, mode):
    if (M, mode) not in MODELS:
        MODELS[(M, mode)] = tiny_tah2(seed=M + 10, max_iterations=M, iteration_attention=mode).double()
    return MODELS[(M, mode)]


def _run(model, batch, extra, args, flat):
    model.deeper_packing = "flat" if flat else "per_row"
    model.zero_grad(set_to_none=True)
    try:
        loss, out, metrics, look = run_case(model, batch.inputs, extra, args)
    finally:
        model.__dict__.pop("deeper_packing", None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, out, metric_values(metrics), look, grads


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), (what, (a - b).abs().max())


@pytest.mark.slow
def test_flat_packing_equals_per_row_packing_over_a_seeded_sweep():
    args = ArgsNS()
    rng = random.Random(2027)
    deep_flat = 0
    for i in range(36):
        M, mode = rng.choice((2, 3, 4)), rng.choice(("duo", "same_iter", "causal"))
        model = _model(M, mode)
        model.train(rng.random() < 0.7)
        (model.gradient_checkpointing_enable if rng.random() < 0.3 else model.gradient_checkpointing_disable)()
        kind, seed = DECIDERS[i % len(DECIDERS)], rng.randrange(10**6)
        padding = PADDINGS[(i // 2) % len(PADDINGS)]
        case = dict(M=M, mode=mode, decider=kind, padding=padding, seed=seed, train=model.training)
        batch = make_batch(random.Random(seed), padding)
        batch.inputs = {k: v for k, v in batch.inputs.items()}
        extra, _ = install_decider(model, kind, seed)
        try:
            flat = _run(model, batch, extra, args, True)
            padded = _run(model, batch, extra, args, False)
        finally:
            install_decider(model, "learned_mixed", 0)
        (loss_f, out_f, met_f, look_f, grad_f), (loss_p, out_p, met_p, look_p, grad_p) = flat, padded
        try:
            _close(loss_f, loss_p, "loss")
            assert torch.equal(out_f.iter_counts, out_p.iter_counts)
            assert set(grad_f) == set(grad_p)
            for name in grad_f:
                _close(grad_f[name], grad_p[name], name)
            rec_f, rec_p = out_f.loop_records, out_p.loop_records
            for a, b in zip(rec_f.token_logprob if rec_f else [], rec_p.token_logprob if rec_p else [], strict=True):
                _close(a, b, "token logprob")
            for a, b in zip(look_f or [], look_p or [], strict=True):
                _close(a, b, "lookahead logprob")
            if hasattr(out_f, "depth_labels"):
                for a, b in zip(out_f.depth_labels.continue_labels, out_p.depth_labels.continue_labels, strict=True):
                    assert torch.equal(a, b)
            assert met_f.keys() == met_p.keys()
            for k in met_f:
                assert met_f[k] == pytest.approx(met_p[k], rel=1e-9, abs=1e-11), k
            # the flat layout runs exactly the active tokens: no padding slots at the deeper depths
            active = [int((out_f.iter_counts >= m).sum()) for m in range(2, len(out_f.rows_per_depth) + 1)]
            if model.training or rec_f is not None:
                assert list(out_f.rows_per_depth[1:]) == active
                deep_flat += sum(active) > 0
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err
    assert deep_flat >= 10


def test_auto_packing_picks_the_layout_with_fewer_flops():
    """Flat where padding costs more than the other rows' keys (ragged rows), per-row where the rows are full
    (nothing to save, only keys to add)."""
    model = tiny_tah2(seed=3, max_iterations=2)
    T = 64
    ragged = torch.zeros(2, T, dtype=torch.bool)
    ragged[0, :60], ragged[1, :4] = True, True
    assert model._flat_is_cheaper(ragged)
    assert not model._flat_is_cheaper(torch.ones(4, T, dtype=torch.bool))
