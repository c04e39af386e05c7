"""Trace capture (analysis.md §1) on tiny random models of every architecture: the recorded final residual gives the
model's own logits, attention recomputed from the recorded post-RoPE Q/K equals the eager weights, the coordinates
are the right ones, and extra recurrences run where the architecture allows them and fail clearly where not."""

from __future__ import annotations

import pytest
import torch
from helpers.common import tiny_qwen3_config
from transformers import Qwen3ForCausalLM

from hf_loops.analysis import residual_metrics as rm
from hf_loops.analysis.attention_metrics import attention_fixed_point_distance, attention_similarity_matrix
from hf_loops.analysis.trace import capture_trace, final_norm_logits
from hf_loops.conversion import convert_qwen3


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config()).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def assert_eager_agrees(trace):
    n = 0
    for step in trace.steps:
        att = step.attention
        if att is None:
            continue
        W = att.weights(chunk_size=5)  # several chunks
        rows = att.row_valid[:, None, :, None].expand_as(W)
        assert att.eager_weights is not None
        torch.testing.assert_close(W[rows], att.eager_weights[rows], atol=1e-6, rtol=1e-5)
        n += 1
    assert n > 0


def assert_restored(model):
    assert model.config._attn_implementation == "sdpa"
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_plain_qwen3(qwen, batch):
    ids, mask = batch
    trace = capture_trace(qwen, ids, mask, attn_implementation="eager")
    assert [s.label for s in trace.steps] == ["t1.l1", "t1.l2"]
    logits = qwen(ids, attention_mask=mask).logits
    real = mask.bool()  # padded query rows see nothing; eager and sdpa fill them differently
    torch.testing.assert_close(final_norm_logits(qwen, trace.steps[-1].residual)[real], logits[real])
    torch.testing.assert_close(final_norm_logits(qwen, trace.steps[-1].residual), trace.output.logits)
    assert_eager_agrees(trace)
    with pytest.raises(ValueError, match="has no loop"):
        capture_trace(qwen, ids, num_recurrences=2)


def test_sdpa_capture_recomputes_the_eager_weights(qwen, batch):
    ids, mask = batch
    sgt = convert_qwen3(qwen, "sgt", loop_plan=[{"layer": 1, "heads": [0, 2], "depth": 1}]).eval()
    for model in (qwen, sgt):
        eager = capture_trace(model, ids, mask, attn_implementation="eager")
        sdpa = capture_trace(model, ids, mask)
        assert all(s.attention.eager_weights is None for s in sdpa.steps if s.attention is not None)
        for a, b in zip(eager.steps, sdpa.steps, strict=False):
            if a.attention is None:
                continue
            rows = a.attention.row_valid[:, None, :, None].expand_as(a.attention.eager_weights)
            torch.testing.assert_close(b.attention.weights()[rows], a.attention.eager_weights[rows])
        real = mask.bool()
        torch.testing.assert_close(sdpa.output.logits[real], model(ids, attention_mask=mask).logits[real])


@pytest.mark.parametrize("keep_routes", [False, True])
def test_tah2_depths_streams_and_logits(qwen, batch, keep_routes):
    ids, mask = batch
    model = convert_qwen3(qwen, "tah2", max_iterations=3).eval()
    with torch.no_grad():
        torch.manual_seed(3)
        model.decider.score.weight.normal_(0.0, 3.0)  # g far from τ: mixed routes
    trace = capture_trace(model, ids, mask, num_recurrences=3, keep_routes=keep_routes, attn_implementation="eager")
    out = trace.output
    assert trace.num_recurrences == 3
    assert_eager_agrees(trace)
    if not keep_routes:
        assert bool((out.iter_counts[mask.bool()] == 3).all())
    for step in trace.steps:
        att = step.attention
        assert step.stage == "loop" and att.key_iter is not None
        assert set(att.key_iter[att.key_valid].tolist()) == set(range(step.recurrence))  # streams 0..m−1
        # query slots map back to the tokens that ran this depth
        ran = out.iter_counts >= step.recurrence
        assert torch.equal(step.valid, ran)
        if step.layer == model.config.num_hidden_layers:
            h = out.iteration_hidden_states[step.recurrence - 1]
            torch.testing.assert_close(model.model.norm(step.residual)[ran], h[ran])
    if keep_routes:
        deeper = [s for s in trace.steps if s.recurrence == 3]
        assert deeper[0].attention.shape[0] < ids.shape[1]  # packed: fewer query slots than tokens
    assert model.config.decider == "learned" and "_continue_logit" not in vars(model)
    assert_restored(model)


def test_tah2_one_depth_gives_qwen3_logits(qwen, batch):
    ids, mask = batch
    model = convert_qwen3(qwen, "tah2", max_iterations=1).eval()
    trace = capture_trace(model, ids, mask)
    real = mask.bool()  # padding never runs a depth: its residual is not recorded
    assert torch.equal(trace.steps[-1].valid, real)
    torch.testing.assert_close(final_norm_logits(model, trace.steps[-1].residual)[real], trace.output.logits[real])


def test_spiralformer_latent_coordinates_and_extrapolation(qwen, batch):
    ids, mask = batch
    model = convert_qwen3(qwen, "spiralformer", num_pre_layers=0, num_loop_layers=1, num_post_layers=1,
                          chunk_sizes=[4, 2, 1], topology="anchor").eval()
    trace = capture_trace(model, ids, mask, attn_implementation="eager")
    assert [s.label for s in trace.steps] == ["t1.l1", "t2.l1", "t3.l1", "post1"]
    T = ids.shape[1]
    for step, g in zip(trace.loop_steps(), [4, 2, 1], strict=False):
        omega = g // 2
        assert step.resolution == 1 / g and step.residual.shape[1] == (T + omega) // g
        assert step.attention.shape == ((T + omega) // g,) * 2
        assert step.valid.sum(1).tolist() == [(n + omega) // g for n in mask.sum(1).tolist()]
    torch.testing.assert_close(final_norm_logits(model, trace.steps[-1].residual)[mask.bool()],
                               trace.output.logits[mask.bool()])
    assert_eager_agrees(trace)
    with pytest.raises(ValueError, match="different resolutions"):
        trace.loop_residuals(1)
    with pytest.raises(ValueError, match="different shape|equal shape"):
        from hf_loops.analysis.attention_metrics import attention_distance

        attention_distance(trace.steps[0].attention.weights(), trace.steps[1].attention.weights())

    longer = capture_trace(model, ids, mask, num_recurrences=8, record=("residual",))
    assert [s.recurrence for s in longer.loop_steps()] == list(range(1, 9))
    assert model.config.chunk_sizes == [4, 2, 1]
    mesh = convert_qwen3(qwen, "spiralformer", num_pre_layers=0, num_loop_layers=1, num_post_layers=1,
                         chunk_sizes=[2, 1], topology="mesh").eval()
    with pytest.raises(ValueError, match="MeSH router per trained iteration"):
        capture_trace(mesh, ids, num_recurrences=32)
    assert_restored(model)


def test_looped_spiralformer_fixed_point_pipeline(qwen, batch):
    ids, mask = batch
    model = convert_qwen3(qwen, "spiralformer", num_pre_layers=0, num_loop_layers=1, num_post_layers=1,
                          chunk_sizes=[1, 1], topology="anchor", core_output="delta").eval()
    trace = capture_trace(model, ids, mask, num_recurrences=32, record=("residual",))
    X, valid = trace.loop_residuals(1)
    assert X.shape[0] == 32 and valid.sum(1).tolist() == mask.sum(1).tolist()  # latents follow positions
    fp = rm.fixed_point_distance_trace(trace)[1]
    assert fp["distance"][-1] == 0
    labels = rm.classify_limiting_behaviour_trace(trace)
    assert sum(labels["counts"].values()) == int(mask.sum())
    short = capture_trace(model, ids, mask, num_recurrences=4)
    D, labels = attention_similarity_matrix(short)
    assert D.shape == (4, 4) and torch.allclose(D, D.T) and bool((D.diagonal() == 0).all())
    to_fp = attention_fixed_point_distance(short)[1]
    assert to_fp.shape == (4,) and to_fp[-1] == 0 and torch.allclose(to_fp[:-1], D[:-1, -1])


def test_sgt_kept_heads_and_loop_depths(qwen, batch):
    ids, mask = batch
    model = convert_qwen3(qwen, "sgt", loop_plan=[{"layer": 1, "heads": [0, 2], "depth": 2}]).eval()
    for masked in (False, True):
        model.model.layers[1].loop_masked = masked
        trace = capture_trace(model, ids, mask, attn_implementation="eager")
        assert [(s.label, s.attention.heads if s.attention else None) for s in trace.steps] == [
            ("pre1", (0, 1, 2, 3)), ("t1.l1", (0, 1, 2, 3)), ("t2.l1", (0, 2)), ("t3.l1", (0, 2)), ("post1", None)]
        assert trace.steps[2].attention.query.shape[1] == 2
        torch.testing.assert_close(final_norm_logits(model, trace.steps[-1].residual), trace.output.logits)
        assert_eager_agrees(trace)
    model.model.layers[1].loop_masked = False
    trace = capture_trace(model, ids, mask, num_recurrences=8, record=("residual",))
    assert [s.recurrence for s in trace.loop_steps()] == list(range(1, 9))
    assert model.model.layers[1].loop_depth == 2

    block = convert_qwen3(qwen, "sgt", loop_mode="block", block_loop_layers=[0], block_loop_depth=2).eval()
    trace = capture_trace(block, ids, mask, num_recurrences=4)
    assert [s.label for s in trace.steps] == ["t1.l1", "t2.l1", "t3.l1", "t4.l1", "post1"]
    torch.testing.assert_close(final_norm_logits(block, trace.steps[-1].residual), trace.output.logits)
    assert block.config.block_loop_depth == 2
    assert_restored(block)


def test_layers_and_record_selection(qwen, batch):
    ids, mask = batch
    trace = capture_trace(qwen, ids, mask, layers=[1], record=("attention",))
    assert trace.steps[0].attention is None and trace.steps[0].residual is None
    assert trace.steps[1].attention is not None and trace.steps[1].residual is None
    long_ids = torch.randint(3, 97, (1, 20))
    assert capture_trace(qwen, long_ids, max_length=8).steps[0].residual.shape[1] == 8
    assert capture_trace(qwen, long_ids, max_length=8, record=("residual",)).steps[0].residual.shape[1] == 20
    with pytest.raises(ValueError, match="record"):
        capture_trace(qwen, ids, record=("logits",))
