"""Two CPU processes (gloo) through `TaH2SFTTrainer`: an evaluation step of a TaH2 with M = 3 whose ranks want different
depths (the depth passes are agreed over ranks, or the lookahead's collectives hang), and one SFT step with the decoder
layers wrapped by FSDP2 `fully_shard` via the Trainer's FSDP settings, compared with one process on the union batch."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers and helpers
sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(HERE, "dist_fsdp_worker.py"), "eval,fsdp", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # a hang fails here
    assert res.returncode == 0, res.stderr[-3000:]
    return {f"{mode}{r}": torch.load(out / f"{mode}_rank{r}.pt", weights_only=False)
            for mode in ("eval", "fsdp") for r in (0, 1)}


def test_evaluation_step_synchronises_depth_passes_across_ranks(two_ranks):
    r0, r1 = two_ranks["eval0"], two_ranks["eval1"]
    m0, m1 = r0["eval_metrics"], r1["eval_metrics"]
    assert m0["eval_loss"] == m1["eval_loss"] and torch.isfinite(torch.tensor(m0["eval_loss"]))
    # rank 0's tokens run all 3 depths, rank 1's stop after depth 1 (equal token counts): mean depth 2
    assert m0["eval_mean_depth"] == pytest.approx(2.0)
    assert m0["eval_continue_rate@2"] == pytest.approx(1.0)
    assert r0["delta_cut"] == r1["delta_cut"] and r0["beta"] == r1["beta"]  # pooled over ranks
    assert len(r0["delta_cut"]) == 2  # M − 1 = 2 depth decisions were labelled


def test_fsdp2_step_matches_one_process_on_the_union_batch(two_ranks, tmp_path):
    from dist_fsdp_worker import main

    a, b = two_ranks["fsdp0"], two_ranks["fsdp1"]
    assert a["wrapped"].startswith("FSDP") and a["sharded_layer"] == "FSDPQwen3DecoderLayer"  # fully_shard applied
    assert a["saved_class"] == "TaH2ForCausalLM"  # rank 0 saves the plain class, not torch's FSDP<Class>
    one = main("fsdp", str(tmp_path))  # one process, the union batch
    assert one["wrapped"] == "TaH2ForCausalLM"
    assert torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), one["input_ids"])
    for m in range(len(one["continue_labels"])):
        assert torch.equal(torch.cat([a["continue_labels"][m], b["continue_labels"][m]]), one["continue_labels"][m])
    assert a["delta_cut"] == b["delta_cut"] and a["beta"] == b["beta"]
    assert a["delta_cut"] == pytest.approx(one["delta_cut"], rel=1e-6, abs=0)
    assert a["beta"] == pytest.approx(one["beta"], rel=1e-6, abs=0)
    # each rank's loss is its share of the global objective (normalised by the global token count)
    assert a["num_items_in_batch"] == b["num_items_in_batch"] == one["num_items_in_batch"]
    assert a["loss"] + b["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert a["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)
    # the gathered full state dict after the step (what `hf-loops train` saves) equals the one-process weights
    assert set(a["weights"]) == set(one["weights"])
    for key, value in one["weights"].items():
        assert (a["weights"][key] - value).abs().max() <= 1e-5, key
