"""TaH2 training under real conditions: the issue's reproductions, and a seeded sweep over the configuration space.

Each sweep case runs `tah2_joint_loss` and the backward pass, and checks a finite loss and gradients, continue labels
/ weights / δ_cut / β equal to the slow reference of spec §4, and (where decisions depend on the token only) that a
padded or packed batch gives each row's per-depth losses, lookahead losses and NLL as the row run alone.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers.tah2_helpers import tiny_qwen3, tiny_tah2
from helpers.tah2_sweep import (
    DECIDERS,
    PADDINGS,
    ArgsNS,
    check_labels_against_reference,
    flatten_records,
    install_decider,
    make_batch,
    reference_labels,
    run_case,
)

from hf_loops.conversion import convert_qwen3
from hf_loops.training.tah2_trainer import TaH2SFTConfig, metric_values, tah2_joint_loss

# ----------------------------------------------------------------------------------------------------------------------
# The reproductions
# ----------------------------------------------------------------------------------------------------------------------


def test_lookahead_with_a_padded_batch_where_no_token_continues(tmp_path):
    m = convert_qwen3(tiny_qwen3(0), "tah2", max_iterations=2, exit_threshold=0.999).train()
    args = TaH2SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, 15:] = 0
    labels = ids.masked_fill(am == 0, -100)
    plain, _, _ = tah2_joint_loss(m, {"input_ids": ids, "labels": labels}, args)
    padded, out, _ = tah2_joint_loss(m, {"input_ids": ids, "attention_mask": am, "labels": labels}, args)
    assert out.iter_counts.max() == 1  # nobody continued: one executed depth, yet the lookahead ran
    assert torch.isfinite(padded) and torch.isfinite(plain)
    padded.backward()


def test_left_padded_loss_is_finite_and_equals_the_row_alone():
    for M in (1, 2, 3):
        m = convert_qwen3(tiny_qwen3(0), "tah2", max_iterations=M).eval()
        ids = torch.tensor([[0, 0, 5, 6, 7]])
        mask = torch.tensor([[0, 0, 1, 1, 1]])
        padded = m(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        alone = m(ids[:, 2:], labels=ids[:, 2:]).loss
        assert torch.isfinite(padded), M
        torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_unused_updater_is_reached_inside_forward_once():
    """No token continues: the updater is not used, yet every trainable updater/decider parameter is part of the
    forward's loss graph (a data-parallel wrapper sees each exactly once) and gets a (zero) gradient."""
    m = tiny_tah2(max_iterations=2, decisive=False).train()  # g ≈ 0.5 < τ everywhere
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    out = m(ids, labels=ids, exit_threshold=0.999)
    assert out.iter_counts.max() == 1
    loss = out.loss
    reached = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in reached:
            continue
        reached.add(fn)
        if hasattr(fn, "variable"):
            reached.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    for name, p in m.named_parameters():
        if name.startswith(("updater.", "decider.")):
            assert id(p) in reached, name
    loss.backward()
    grad = m.updater.norm_out.weight.grad
    assert grad is not None and float(grad.abs().sum()) == 0.0


# ----------------------------------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------------------------------

MODELS = {}


def model_for(M, mode):
    if (M, mode) not in MODELS:
        MODELS[(M, mode)] = tiny_tah2(seed=M, max_iterations=M, iteration_attention=mode)
    return MODELS[(M, mode)]


def sweep_cases(n, seed):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        cases.append(dict(
            M=rng.choice((2, 3, 4)),
            mode=rng.choice(("duo", "same_iter")),
            decider=DECIDERS[i % len(DECIDERS)],
            padding=PADDINGS[(i // len(DECIDERS)) % len(PADDINGS)],
            train=rng.random() < 0.7,
            checkpointing=rng.random() < 0.3,
            seed=rng.randrange(10**6),
        ))
    return cases


def _row_view(out, look, b, positions):
    """Per real position of row b: executed depths, ℓ(m) and lookahead values."""
    rec = out.loop_records
    return (
        [[bool(e[b, t]) for e in rec.executed] for t in positions],
        [[float(lp[b, t]) for lp in rec.token_logprob] for t in positions],
        [[float(lp[b, t]) for lp in look] for t in positions],
    )




def _compare_rows_alone(model, batch, extra, args, out, look, metrics):
    inputs = batch.inputs
    nll_rows = 0.0
    for b, row in enumerate(batch.rows):
        _, out_r, met_r, look_r = run_case(model, row, extra, args, backward=False)
        nll_rows += float(met_r["ntp_loss"][0])
        if "position_ids" in inputs:  # packed: the documents sit one after another in row 0
            start = sum(r["input_ids"].shape[1] for r in batch.rows[:b])
            positions, bb = list(range(start, start + row["input_ids"].shape[1])), 0
        else:
            mask = inputs.get("attention_mask")
            positions = list(range(inputs["input_ids"].shape[1]))
            if mask is not None:
                positions = [t for t in positions if mask[b, t]]
            bb = b
        ex_b, lp_b, lk_b = _row_view(out, look, bb, positions)
        ex_r, lp_r, lk_r = _row_view(out_r, look_r, 0, list(range(row["input_ids"].shape[1])))
        for t in range(len(positions)):
            d = sum(ex_r[t])
            assert sum(ex_b[t]) == d, (b, t)
            for m in range(d):
                assert abs(lp_b[t][m] - lp_r[t][m]) < 2e-5, ("token logprob", b, t, m)
                if m < len(lk_r[t]):
                    assert abs(lk_b[t][m] - lk_r[t][m]) < 2e-5, ("lookahead", b, t, m)
    assert abs(float(metrics["ntp_loss"][0]) - nll_rows) < 1e-4 * max(1.0, abs(nll_rows))


@pytest.mark.slow
def test_training_sweep_over_deciders_padding_depths_modes_and_checkpointing():
    args = ArgsNS()
    compared = 0
    seen = set()  # (padding, how deep the batch went) pairs the sweep actually reached
    for case in sweep_cases(140, seed=1234):
        model = model_for(case["M"], case["mode"])
        model.train(case["train"])
        if case["checkpointing"]:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        extra, script = install_decider(model, case["decider"], case["seed"])
        batch = make_batch(random.Random(case["seed"]), case["padding"])
        model.zero_grad(set_to_none=True)
        try:
            loss, out, metrics, look = run_case(model, batch.inputs, extra, args)
            rec = out.loop_records
            B, T = rec.targets.shape
            deepest = int(out.iter_counts.max())
            seen.add((case["padding"], "stop" if deepest == 1 else "full" if deepest == case["M"] else "partial"))
            flat = flatten_records(rec, look)
            ref = reference_labels(*flat, case["M"], args.coverage, args.cost_min, args.cost_max, args.beta_clamp)
            check_labels_against_reference(out.depth_labels, ref, B, T)
            values = metric_values(metrics)
            assert 1.0 <= values["mean_depth"] <= case["M"] or values["mean_depth"] == 0.0
            if script is not None:
                compared += 1
                with torch.no_grad():
                    _compare_rows_alone(model, batch, extra, args, out, look, metrics)
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err
        finally:
            install_decider(model, "learned_mixed", 0)
    assert compared >= 60
    for padding in PADDINGS:  # every layout met all-stop and all-continue batches; the padded ones partial depth too
        wanted = ("stop", "full") + (("partial",) if padding in ("right", "left") else ())
        assert {(padding, w) for w in wanted} <= seen, (padding, sorted(seen))


@pytest.mark.parametrize("M", [2, 3])
def test_sweep_covers_some_depth2_none_depth3_and_a_fully_padded_row(M):
    """The corner the crash came from, pinned: depths stop short of M, and a row with no token at all."""
    model = tiny_tah2(seed=7, max_iterations=M).train()
    extra, _ = install_decider(model, "script_only_depth2", 5)
    batch = make_batch(random.Random(3), "left_with_empty_row")
    loss, out, metrics, look = run_case(model, batch.inputs, extra, ArgsNS())
    assert out.iter_counts[-1].sum() == 0  # the empty row ran nothing
    assert out.iter_counts.max() <= 2
    assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_training_sweep_on_two_gloo_ranks_with_different_depths(tmp_path):
    """The sweep under DDP (with and without unused-parameter detection): ranks execute different depths, often one
    rank continues nothing; loss, backward, gradient sync and pooled labels all hold."""
    out = tmp_path / "report.json"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers
    # A clean environment: state that earlier in-process runs left in os.environ (accelerate/torch.distributed
    # variables) must not reach the two ranks.
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]), OMP_NUM_THREADS="1", HF_SWEEP_WATCHDOG_S="240")
    # --standalone: torchrun picks its own free port (no race between choosing a port and binding it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(here, "helpers", "dist_sweep_worker.py"), str(out), "40"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    errors = [line for line in res.stderr.splitlines() if "Error" in line or "File " in line]
    assert res.returncode == 0, "\n".join(errors[-40:]) or res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["cases"] == 40
    assert report["rank_without_continuation"] >= 8 and report["depths_differ"] >= 8, report


# ----------------------------------------------------------------------------------------------------------------------
# Logged metrics and predictions through the Trainer
# ----------------------------------------------------------------------------------------------------------------------


def _needs_shared_tokenizer():
    from helpers.trainer_metrics_worker import SHARED_TOKENIZER

    if not os.path.isdir(SHARED_TOKENIZER):
        pytest.skip("../shared/data/qwen3-tokenizer is not present")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_logged_losses_mean_the_same_for_any_accumulation_and_process_count(tmp_path):
    _needs_shared_tokenizer()
    from helpers.trainer_metrics_worker import build_trainer, logged

    one = logged(build_trainer(str(tmp_path / "a"), per_device=4, accumulation=1))
    accumulated = logged(build_trainer(str(tmp_path / "b"), per_device=2, accumulation=2))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "c" / "logs.json"
    out.parent.mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(here, "helpers", "trainer_metrics_worker.py"), str(out), "2", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world"] == 2
    for key in ("loss", "ntp_loss", "decider_loss", "mean_depth", "continue_rate@1", "decider_acc@1"):
        assert accumulated[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # The joint loss is the NTP loss plus α_D times the decider loss, in the same units.
    assert one["loss"] == pytest.approx(one["ntp_loss"] + 0.05 * one["decider_loss"], rel=1e-4)


@pytest.mark.slow
def test_predict_returns_the_mixture_log_probabilities(tmp_path):
    _needs_shared_tokenizer()
    from helpers.trainer_metrics_worker import build_trainer

    trainer = build_trainer(str(tmp_path), per_device=2, accumulation=1, per_device_eval_batch_size=2)
    seen = {}

    def compute_metrics(pred):
        seen["shape"] = pred.predictions.shape
        return {"n": float(pred.predictions.shape[0])}

    trainer.compute_metrics = compute_metrics
    pred = trainer.predict(trainer.train_dataset)
    logp = torch.as_tensor(pred.predictions)
    assert logp.dim() == 3 and logp.shape[0] == 4 and logp.shape[-1] == trainer.model.config.vocab_size
    labels = torch.as_tensor(pred.label_ids)
    real = labels != -100  # positions of real tokens (padding has label -100 and a zero row)
    sums = torch.logsumexp(logp.float(), -1)[real]
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-4)  # log-probabilities of a distribution
    assert seen["shape"] == tuple(logp.shape) and pred.metrics["test_n"] == 4.0
