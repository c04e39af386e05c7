"""The SFT step's fast paths compute what the plain ones compute.

- `_LinearSharedWeight`: the per-depth gradients of a shared linear weight are summed inside the products (`addmm_`
  into one buffer that the weight's first call returns) instead of by autograd; the gradient equals `F.linear`'s
  whatever order the calls backpropagate in, when some never do, over a second backward and under
  `torch.autograd.grad` on part of the graph; and no weight-sized add is left.
- `target_log_prob_and_topk`: the mixture's log q(m)[y] and the decider's top-k probabilities from one pass over the
  logits equal the two separate read-outs, gradients included.
- The joint loss (`tah2_joint_loss`) with both paths on equals the plain computation: loss, every parameter's
  gradient, routes, labels, δ_cut and β (float64).
"""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers.tah2_helpers import tiny_qwen3
from helpers.tah2_sweep import ArgsNS, make_batch

import hf_loops.modeling.modeling_tah2 as tah2
from hf_loops.conversion import convert_qwen3
from hf_loops.training.tah2_trainer import tah2_joint_loss

# ----------------------------------------------------------------------------------------------------------------------
# Shared weight gradients
# ----------------------------------------------------------------------------------------------------------------------


def _three_calls(weight, xs, shared: bool):
    """Uses of one weight, one per input, as the depths of a forward make them."""
    if not shared:
        return [F.linear(x, weight) for x in xs]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = weight
    with tah2._SharedWeightLinears([layer]) as ctx:
        assert ctx.layers == [layer]
        return [layer(x) for x in xs]


@pytest.mark.parametrize("queries", [True, False], ids=["engine_queries", "own_products"])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (0,), (1, 2)])
def test_shared_weight_gradient_equals_plain_linear_for_any_subset_of_used_calls(used, queries, monkeypatch):
    """`own_products`: a torch without the engine queries, where every call returns its own product."""
    monkeypatch.setattr(tah2, "_ENGINE_QUERIES", tah2._ENGINE_QUERIES and queries)
    torch.manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64)
    xs = [torch.randn(2, n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 2, 4)]
    grads = []
    for shared in (False, True):
        weight = torch.nn.Parameter(w.clone())
        ys = _three_calls(weight, xs, shared)
        loss = sum((ys[i] * (i + 1)).pow(2).sum() for i in used)
        x_grads = torch.autograd.grad(loss, [xs[i] for i in used], retain_graph=True)  # the weight not asked for
        (w_grad,) = torch.autograd.grad(loss, [weight], retain_graph=True)  # the weight alone
        loss.backward()
        grads.append((weight.grad.clone(), w_grad, x_grads))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1][1], grads[0][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1][2], grads[0][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_shared_weight_gradient_when_the_first_call_runs_first_and_over_two_backwards():
    """The first call backpropagates alone before the others, then the others twice over a retained graph: the
    gradients accumulate like nn.Linear's."""
    torch.manual_seed(1)
    w = torch.randn(3, 4, dtype=torch.float64)
    xs = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]
    got = []
    for shared in (False, True):
        weight = torch.nn.Parameter(w.clone())
        ys = _three_calls(weight, xs, shared)
        ys[0].sum().backward()  # the owner alone first
        (ys[1].pow(2).sum() + ys[2].sum()).backward(retain_graph=True)
        (ys[1].pow(2).sum() + ys[2].sum()).backward()
        got.append(weight.grad.clone())
    torch.testing.assert_close(got[1], got[0], rtol=1e-12, atol=1e-12)


def test_shared_weight_linears_leave_other_layers_alone_and_restore_forward():
    plain = torch.nn.Linear(4, 3, bias=False)
    biased = torch.nn.Linear(4, 3)
    frozen = torch.nn.Linear(4, 3, bias=False).requires_grad_(False)

    class Sub(torch.nn.Linear):
        pass

    sub = Sub(4, 3, bias=False)
    with tah2._SharedWeightLinears([plain, biased, frozen, sub]) as ctx:
        assert ctx.layers == [plain]
        assert "forward" in vars(plain)
    assert all("forward" not in vars(m) for m in (plain, biased, frozen, sub))
    assert tah2._SharedWeightLinears([plain], enabled=False).layers == []


def test_shared_weight_gradients_are_summed_inside_the_products():
    """Two depths' gradients of one weight: nn.Linear's are summed out of place (a fresh weight-sized tensor); the
    shared-weight products leave no weight-sized add at all (`addmm_` into one buffer), the point of the path."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(3)
    xs = [torch.randn(2, n, 16) for n in (5, 3)]
    ops = []
    for shared in (False, True):
        weight = torch.nn.Parameter(torch.randn(32, 16))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            sum(y.sum() for y in _three_calls(weight, xs, shared)).backward()
        ops.append([e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")
                    and e.input_shapes and list(e.input_shapes[0]) == [32, 16]])
    assert ops == [["aten::add"], []]


# ----------------------------------------------------------------------------------------------------------------------
# One read-out pass for log q(m)[y] and the decider's top-k
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_log_prob_and_topk_equal_the_separate_read_outs(dtype):
    torch.manual_seed(2)
    n, vocab, k = 70, 1000, 37  # 70 rows: more than one vocabulary block of the CPU path
    z0 = torch.randn(n, vocab, dtype=dtype) * 3
    y = torch.randint(0, vocab, (n,))
    y[:10] = z0[:10].argmax(-1)  # targets inside the top-k: both read-outs scatter to the same column
    g_t, g_p = torch.randn(n, dtype=torch.float32), torch.randn(n, k, dtype=torch.float32)
    outs = []
    for fused in (False, True):
        z = z0.clone().requires_grad_()
        if fused:
            t, p = tah2.target_log_prob_and_topk(z, y, k)
        else:
            t, p = tah2.target_log_prob(z, y), tah2.topk_probs(z, k)
        ((t * g_t).sum() + (p * g_p).sum()).backward()
        outs.append((t.detach(), p.detach(), z.grad))
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])  # same forward arithmetic
    torch.testing.assert_close(outs[1][2], outs[0][2], rtol=1e-6, atol=1e-7)  # fp32 read-out: one sum, not two


def test_decider_with_given_top_probs_equals_decider_reading_logits():
    model = convert_qwen3(tiny_qwen3(0), "tah2", max_iterations=2, decider_topk=150)  # k > vocabulary 97: padded
    e, h, z = torch.randn(5, 32), torch.randn(5, 32), torch.randn(5, 97)
    _, top = tah2.target_log_prob_and_topk(z, torch.zeros(5, dtype=torch.long), 97)
    assert torch.equal(model.decider(e, h, z, top_probs=top), model.decider(e, h, z))


# ----------------------------------------------------------------------------------------------------------------------
# The joint loss with the fast paths equals the plain computation
# ----------------------------------------------------------------------------------------------------------------------


def _joint(seed, fast: bool, M: int, mode: str, padding: str, tied: bool):
    qwen = tiny_qwen3(seed, tie_word_embeddings=tied)
    model = convert_qwen3(qwen, "tah2", max_iterations=M, iteration_attention=mode).train().double()
    with torch.no_grad():
        torch.manual_seed(seed + 1)
        model.decider.score.weight.normal_(0.0, 3.0)
    model.weight_grads_in_place = fast
    if not fast:  # the learned decider reads its own top-k; the step computes log q(m)[y] separately
        model._reads_topk_in_training = lambda: False
    calls = []
    apply = tah2._LinearSharedWeight.apply
    tah2._LinearSharedWeight.apply = lambda x, w, *rest: calls.append(w) or apply(x, w, *rest)
    try:
        batch = make_batch(random.Random(seed), padding)
        loss, out, metrics = tah2_joint_loss(model, {**batch.inputs, "exit_threshold": 0.5}, ArgsNS())
        loss.backward()
    finally:
        tah2._LinearSharedWeight.apply = apply
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, out, calls


@pytest.mark.parametrize("seed,M,mode,padding,tied", [
    (0, 2, "duo", "right", False), (1, 3, "duo", "packed", True), (2, 2, "same_iter", "left", False),
    (3, 3, "duo", "left_with_empty_row", False),
])
def test_joint_loss_with_the_fast_paths_equals_the_plain_computation(seed, M, mode, padding, tied):
    plain_loss, plain_grads, plain_out, plain_calls = _joint(seed, False, M, mode, padding, tied)
    loss, grads, out, calls = _joint(seed, True, M, mode, padding, tied)
    assert not plain_calls and len(calls) > len({id(w) for w in calls})  # the path ran, some weight at two depths
    assert torch.equal(out.iter_counts, plain_out.iter_counts)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        # The read-out is fp32 even in a float64 model (log-softmax in fp32, spec §2.4); the fused one sums its two
        # gradient terms once instead of twice, so the gradients agree to fp32 rounding of their largest entry.
        ref = plain_grads[name]
        assert (g - ref).abs().max() <= 1e-6 * ref.abs().max() + 1e-12, name
    a, b = out.depth_labels, plain_out.depth_labels
    assert a.delta_cut == b.delta_cut and a.beta == b.beta
    for x, y in zip(a.continue_labels + a.weights, b.continue_labels + b.weights, strict=True):
        assert torch.equal(x, y)


def test_fast_paths_are_off_under_checkpointing_and_autocast():
    model = convert_qwen3(tiny_qwen3(0), "tah2", max_iterations=2).train()
    assert model._weight_grads_in_place(2, torch.device("cpu")).layers
    assert not model._weight_grads_in_place(1, torch.device("cpu")).layers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not model._weight_grads_in_place(2, torch.device("cpu")).layers
    with torch.no_grad():
        assert not model._weight_grads_in_place(2, torch.device("cpu")).layers
    model.gradient_checkpointing_enable()
    assert not model._weight_grads_in_place(2, torch.device("cpu")).layers
