"""Lookahead depth supervision: labels against hand-computed examples, the lookahead pass, the joint loss."""

import types

import pytest
import torch
from helpers.tah2_helpers import pattern_by_hidden, script_decider, tiny_tah2

from hf_loops.modeling.modeling_tah2 import iteration_visibility
from hf_loops.training.tah2_labels import compute_depth_labels, coverage_cutoff, decider_bce_sum
from hf_loops.training.tah2_trainer import TaH2SFTConfig, metric_values, tah2_joint_loss


def one_boundary(deltas, executed=None, supervised=None, **kw):
    d = torch.tensor([deltas], dtype=torch.float32)
    a = torch.ones_like(d, dtype=torch.bool) if executed is None else torch.tensor([executed])
    s = torch.ones_like(d, dtype=torch.bool) if supervised is None else torch.tensor([supervised])
    # ℓ(1) = δ, ℓ(2) = 0  ⇒  gain δ
    return compute_depth_labels([a], [d], [torch.zeros_like(d)], s, 2, **kw)


def test_worked_example_of_the_spec():
    lab = one_boundary([0.60, 0.30, 0.095, 0.003, 0.002, -0.20])
    assert lab.delta_cut[0] == pytest.approx(0.095)
    assert lab.continue_labels[0].int().tolist() == [[1, 1, 1, 0, 0, 0]]
    assert lab.iter_count_labels.tolist() == [[2, 2, 2, 1, 1, 1]]
    assert lab.weights[0][0].tolist() == pytest.approx([0.505, 0.205, 1e-6, 0.092, 0.093, 0.295], abs=1e-6)
    assert lab.beta == [1.0]


def test_cutoff_with_ties_keeps_every_tied_token():
    # gains 0.4, 0.3, 0.3, 0.3 (sum 1.3); ρ·sum = 1.287 is first reached at the 4th → δ_cut = 0.3; all ties continue
    lab = one_boundary([0.4, 0.3, 0.3, 0.3, 0.0])
    assert lab.delta_cut[0] == pytest.approx(0.3)
    assert lab.continue_labels[0].int().tolist() == [[1, 1, 1, 1, 0]]
    assert coverage_cutoff(torch.tensor([0.5, 0.5]), 0.5) == 0.5


def test_no_positive_gain_gives_no_continue_labels_and_zero_cut_for_weights():
    lab = one_boundary([-0.1, 0.0, -0.3])
    assert lab.delta_cut == [0.0]
    assert not lab.continue_labels[0].any()
    assert lab.weights[0][0].tolist() == pytest.approx([0.1, 1e-6, 0.3], abs=1e-7)
    assert lab.beta == [1.0]  # one class only


def test_stop_propagates_across_depths_m3_and_weights_for_already_stopped():
    # Three tokens run depth 3 in the main forward. Token 1 is labelled stop at m=1 (small gain), so at m=2 it is no
    # candidate even with a huge gain, and its weight is cost_min.
    a = torch.ones(1, 3, dtype=torch.bool)
    l1 = torch.tensor([[1.0, 1.0, 1.0]])
    l2 = torch.tensor([[0.5, 0.999, 0.6]])  # gains at m=1: 0.5, 0.001, 0.4
    l3 = torch.tensor([[0.1, 0.0, 0.6]])  # gains at m=2: 0.4, 0.999, 0.0
    lab = compute_depth_labels([a, a, a], [l1, l2, l3], [l2, l3], torch.ones_like(a), 3, coverage=0.9)
    assert lab.continue_labels[0].int().tolist() == [[1, 0, 1]]
    assert lab.delta_cut[1] == pytest.approx(0.4)
    assert lab.continue_labels[1].int().tolist() == [[1, 0, 0]]
    assert lab.weights[1][0, 1] == pytest.approx(1e-6)
    assert lab.weights[1][0, 0] == pytest.approx(1e-6)  # at the cutoff: |δ − δ_cut| = 0 → clipped to cost_min
    assert lab.iter_count_labels.tolist() == [[3, 1, 2]]


def test_weights_clip_to_cost_max_and_unsupervised_tokens_get_no_term():
    lab = one_boundary([3.0, 0.5, 0.2], supervised=[True, True, False], coverage=0.5)
    assert lab.delta_cut[0] == pytest.approx(3.0)
    w = lab.weights[0][0].tolist()
    assert w[0] == pytest.approx(1e-6) and w[1] == pytest.approx(1.0) and w[2] == 0.0  # |0.5−3| clipped to 1
    assert lab.bce_mask[0].tolist() == [[True, True, False]]


def test_beta_is_clamped():
    deltas = [5.0] + [0.0] * 99  # 1 continue, 99 stop → β = 99 → clamped to 50
    assert one_boundary(deltas).beta == [50.0]
    assert one_boundary(deltas, beta_clamp=None).beta == [99.0]


def test_bce_uses_pos_weight_and_weights():
    lab = one_boundary([0.6, 0.0, 0.0])  # δ_cut = 0.6: labels [1, 0, 0], weights [1e-6 (at the cut), 0.6, 0.6]
    assert lab.beta == [2.0]
    logits = [torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)]
    total = decider_bce_sum(logits, lab)
    sig = torch.sigmoid
    manual = (1e-6 * 2.0 * -torch.log(sig(torch.tensor(0.3))) + 0.6 * -torch.log(1 - sig(torch.tensor(-0.2)))
              + 0.6 * -torch.log(1 - sig(torch.tensor(0.1))))
    assert total.item() == pytest.approx(manual.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The lookahead pass
# ---------------------------------------------------------------------------------------------------------------------


def _records(model, ids, **kw):
    out = model(ids, labels=ids, use_cache=False, return_loop_records=True, **kw)
    return out, out.loop_records


@pytest.mark.parametrize("M", [2, 3])
def test_lookahead_equals_main_next_iteration_loss_for_continuing_tokens(M):
    model = script_decider(tiny_tah2(max_iterations=M), pattern_by_hidden)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, rec = _records(model, ids)
        look = model.lookahead_logprobs(rec)
    assert len(look) == min(len(rec.executed), M - 1)
    for m in range(1, len(rec.executed)):
        cont = rec.executed[m]
        stopped = rec.executed[m - 1] & ~cont
        assert cont.any() and stopped.any()
        assert (look[m - 1][cont] - rec.token_logprob[m][cont]).abs().max() <= 1e-5
        assert torch.all(look[m - 1][stopped] != 0)  # stopped tokens get a real ℓ(m+1)


def test_lookahead_query_never_sees_another_tokens_lookahead_state():
    # Predicate: at d = 1 a key in the lookahead stream is visible only if its token continued, or it is the query's own.
    key_pos, key_iter = torch.tensor([[0, 1, 2, 0, 1, 2]]), torch.tensor([[0, 0, 0, 1, 1, 1]])
    cont = torch.tensor([[False, False, False, True, False, False]])
    vis = iteration_visibility("duo_posterior", torch.tensor([[0, 1, 2]]), 1, key_pos, key_iter,
                               torch.ones(1, 6, dtype=torch.bool), key_continue=cont)
    assert vis[0, 2].tolist() == [True, True, True, True, False, True]  # token 1's lookahead state hidden
    # End to end: perturbing the lookahead input of one stopped token changes only that token's lookahead loss.
    model = script_decider(tiny_tah2(max_iterations=2), pattern_by_hidden)
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, rec = _records(model, ids)
        base = model.lookahead_logprobs(rec)[0]
        stopped = (rec.executed[0] & ~rec.executed[1]).nonzero()[:, 1]
        victim = int(stopped[0])
        original = model._next_input

        def perturbed(e, h, z):
            out = original(e, h, z)
            hit = (h == rec.hidden[0][0, victim]).all(-1)  # h(1) identifies the position
            return out + 5.0 * hit[:, None].float()

        model._next_input = perturbed
        changed = model.lookahead_logprobs(rec)[0]
    diff = (changed - base).abs()[0]
    assert diff[victim] > 1e-3
    others = torch.ones(12, dtype=torch.bool)
    others[victim] = False
    assert diff[others].max() <= 1e-6


def test_packed_lookahead_equals_separate_rows():
    model = script_decider(tiny_tah2(max_iterations=3), pattern_by_hidden)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 97, (1, 7), generator=g), torch.randint(3, 97, (1, 6), generator=g)
    packed = torch.cat([a, b], 1)
    labels = packed.clone()
    labels[0, 7] = -100  # the first target of the second document belongs to no document
    pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
    with torch.no_grad():
        out_p = model(packed, position_ids=pos, labels=labels, use_cache=False, return_loop_records=True)
        look_p = model.lookahead_logprobs(out_p.loop_records)
        sep = [model(x, labels=x, use_cache=False, return_loop_records=True) for x in (a, b)]
        look_s = [model.lookahead_logprobs(o.loop_records) for o in sep]
    for m in range(len(look_p)):
        joined = torch.cat([look_s[0][m], look_s[1][m]], 1)
        assert (look_p[m] - joined).abs().max() <= 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# Joint loss and gradients
# ---------------------------------------------------------------------------------------------------------------------


def _args(**kw):
    base = dict(coverage=0.99, decider_loss_weight=0.05, cost_min=1e-6, cost_max=1.0, beta_clamp=(0.02, 50.0),
                bce_margin=0.0, lookahead=True)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_joint_loss_is_ntp_plus_weighted_bce_and_reaches_the_decider_both_ways():
    model = tiny_tah2(max_iterations=2, decisive=False).train()
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    loss, out, metrics = tah2_joint_loss(model, {"input_ids": ids, "labels": ids}, _args())
    values = metric_values(metrics)
    assert abs(float(loss.detach()) - (values["ntp_loss"] + 0.05 * values["decider_loss"])) < 1e-5
    for key in ("mean_depth", "continue_rate@1", "delta_cut@1", "beta@1", "decider_acc@1", "label_continue_rate@1"):
        assert key in metrics
    # BCE gradient on the decider scales with α_D
    g = {}
    for alpha in (0.0, 1.0):
        model.zero_grad()
        _, o, m = tah2_joint_loss(model, {"input_ids": ids, "labels": ids}, _args(decider_loss_weight=alpha))
        (tah2_joint_loss(model, {"input_ids": ids, "labels": ids},
                                                 _args(decider_loss_weight=alpha))[0]).backward()
        g[alpha] = model.decider.score.weight.grad.clone()
    assert not torch.allclose(g[0.0], g[1.0])
    assert g[0.0].abs().sum() > 0  # NTP alone reaches the decider through ω


def test_gradient_checkpointing_on_equals_off_for_the_joint_loss():
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(4))

    def run(checkpointing):
        model = tiny_tah2(max_iterations=3).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        loss, _, _ = tah2_joint_loss(model, {"input_ids": ids, "labels": ids}, _args())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    la, ga = run(False)
    lb, gb = run(True)
    assert torch.allclose(la, lb, atol=1e-6)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-5), n


def test_sft_config_validates_supervision_knobs():
    common = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match="coverage"):
        TaH2SFTConfig(coverage=0.0, **common)
    with pytest.raises(ValueError, match="decider_loss_weight"):
        TaH2SFTConfig(decider_loss_weight=-1.0, **common)
    with pytest.raises(ValueError, match="cost_min"):
        TaH2SFTConfig(cost_min=0.5, cost_max=0.1, **common)
    with pytest.raises(ValueError, match="beta"):
        TaH2SFTConfig(beta_clamp_min=10.0, beta_clamp_max=1.0, **common)
    cfg = TaH2SFTConfig(**common)
    assert (cfg.coverage, cfg.decider_loss_weight, cfg.beta_clamp) == (0.99, 0.05, (0.02, 50.0))
