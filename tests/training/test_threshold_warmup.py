"""The threshold warm-up (`base_warmup_steps`): τ ramps from ~0 to the model's exit_threshold over the first steps."""

import json

import pytest
from helpers.train_cli_helpers import tiny_train_setup  # noqa: F401  (the `data` fixture)

from hf_loops.training.tah2_trainer import TaH2SFTConfig
from hf_loops.training.train_tah2 import run as train_run


def _argv(data, out, *extra):
    return ["--base", data["base"], "--tokenizer", data["tokenizer"], "--arch", "tah2", "--dataset", data["train"],
            "--output-dir", str(out), "--recipe", "tiny-cpu", "--max_steps", "5", "--logging_steps", "1",
            "--exit-threshold", "0.9", "--disable_tqdm", "true", *extra]


def test_warmup_ramps_tau_and_leaves_the_saved_threshold(data, tmp_path):
    trainer = train_run(_argv(data, tmp_path / "out", "--base_warmup_steps", "4"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 5
    # Step 0: τ ≈ 0, so every supervised token continues to depth 2 whatever the decider says.
    assert logs[0]["continue_rate@1"] == 1.0 and logs[0]["mean_depth"] == 2.0
    model = trainer.model
    model.train()
    for step, want in ((0, 1e-6), (1, 0.225), (2, 0.45), (3, 0.675), (4, None), (9, None)):
        trainer.state.global_step = step
        got = trainer.warmup_threshold(model)
        assert (got is None and want is None) or got == pytest.approx(want), (step, got)
    model.eval()
    trainer.state.global_step = 0
    assert trainer.warmup_threshold(model) is None  # evaluation uses the model's own τ
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["exit_threshold"] == 0.9


def test_without_warmup_tau_is_the_models(data, tmp_path):
    trainer = train_run(_argv(data, tmp_path / "out", "--max_steps", "1"))
    trainer.model.train()
    trainer.state.global_step = 0
    assert trainer.warmup_threshold(trainer.model) is None


def test_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="base_warmup_steps"):
        TaH2SFTConfig(output_dir="x", base_warmup_steps=-1, use_cpu=True, report_to="none")
