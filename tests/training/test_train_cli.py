"""`hf-loops train` options: eval data, TaH2Config fields on the command line, `none` for optional fields,
remote-code Trainer checkpoints, truncation that empties examples, one-line failures; and the exact float round trip
of the official TaH2 layout."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers.tah2_helpers import tiny_tah2
from helpers.train_cli_helpers import CHILD, _argv, _qa, tiny_train_setup  # noqa: F401  (the `data` fixture)

from hf_loops.training import train_tah2
from hf_loops.training.train_tah2 import main as train_main
from hf_loops.training.train_tah2 import run as train_run


def _losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h]


# 1. --eval-dataset / --eval-split

def test_eval_dataset_is_passed_to_the_trainer_and_evaluated(data, tmp_path):
    split_dir = tmp_path / "evaldir"
    split_dir.mkdir()
    (split_dir / "train.jsonl").write_text(open(data["train"]).read())
    (split_dir / "test.jsonl").write_text(open(data["eval"]).read())
    trainer = train_run(_argv(data, tmp_path / "out", "--eval-dataset", str(split_dir), "--eval-split", "test"))
    assert len(trainer.eval_dataset) == 3  # the test split, tokenised like the training data
    assert set(trainer.eval_dataset.column_names) >= {"input_ids", "labels"}
    # No eval_strategy given: evaluated at the end of each epoch, which includes the end of a max_steps run.
    assert trainer.args.eval_strategy == "epoch"
    evals = _losses(trainer, "eval_loss")
    assert len(evals) == 1 and torch.isfinite(torch.tensor(evals[0]))
    assert "eval_mean_depth" in [h for h in trainer.state.log_history if "eval_loss" in h][0]


def test_eval_strategy_default_follows_the_given_fields(tmp_path):
    cfg = train_tah2.trainer_config
    out = str(tmp_path)
    assert cfg({}, ["--use_cpu", "true"], out, eval_dataset=False).eval_strategy == "no"
    assert cfg({}, ["--use_cpu", "true"], out, eval_dataset=True).eval_strategy == "epoch"
    steps = cfg({}, ["--use_cpu", "true", "--eval_steps", "5"], out, eval_dataset=True)
    assert steps.eval_strategy == "steps" and steps.eval_steps == 5
    assert cfg({"eval_strategy": "no"}, ["--use_cpu", "true"], out, eval_dataset=True).eval_strategy == "no"
    assert cfg({}, ["--use_cpu", "true", "--eval-strategy=steps"], out, eval_dataset=True).eval_strategy == "steps"


# 2. Every TaH2Config field on the command line

def test_model_fields_come_from_the_config_class():
    from transformers import Qwen3Config

    from hf_loops.modeling.configuration_tah2 import TaH2Config

    fields = train_tah2.model_fields()
    assert {"max_iterations", "exit_threshold", "iteration_attention", "decision_mode", "mixture", "updater",
            "decider", "decider_topk", "updater_topk", "updater_intermediate_size", "decider_intermediate_size",
            "updater_norm_pre_mlp", "updater_norm_out"} <= set(fields)
    assert set(fields) == set(TaH2Config.__dataclass_fields__) - set(Qwen3Config.__dataclass_fields__)
    text = " ".join(train_tah2.build_parser(fields).format_help().split())
    for name in fields:
        assert f"--{name}" in text, name
    assert "--iteration-attention VALUE" in text and "visibility across iterations" in text  # the config docstring
    assert train_tah2.parse_model_value(fields["loop_span"], "[1, 3]") == [1, 3]


def test_tah2_config_fields_on_the_command_line_override_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("iteration_attention: causal\nmixture: even\nupdater_topk: 3\nlearning_rate: 1.0e-3\n")
    fields = train_tah2.model_fields()
    args, rest = train_tah2.build_parser(fields).parse_known_args(
        ["--base", "b", "--dataset", "d", "--output-dir", "o", "--iteration_attention", "same_iter",
         "--updater-topk", "7", "--updater_norm_out", "false", "--decider_topk", "none", "--max-iterations", "3",
         "--exit_threshold", "0.3", "--decision-mode", "sample", "--learning_rate", "1e-4"])
    assert rest == ["--learning_rate", "1e-4"]  # trainer fields pass through
    loaded = train_tah2.load_recipe(str(recipe))
    out = train_tah2.model_overrides("tah2", loaded, args, fields)
    assert out == {"iteration_attention": "same_iter", "mixture": "even", "updater_topk": 7, "updater_norm_out": False,
                   "decider_topk": None, "max_iterations": 3, "exit_threshold": 0.3, "decision_mode": "sample"}
    assert loaded == {"learning_rate": 1.0e-3}  # model keys do not reach the trainer config
    # --arch standard keeps its one-pass preset against a recipe (recipes describe TaH2 runs)
    args, _ = train_tah2.build_parser(fields).parse_known_args(["--base", "b", "--dataset", "d", "--output-dir", "o"])
    std = train_tah2.model_overrides("standard", {"max_iterations": 2, "mixture": "even"}, args, fields)
    assert std["max_iterations"] == 1 and std["mixture"] == "even"


@pytest.mark.parametrize("flag, value", [("--iteration_attention", "sideways"), ("--max-iterations", "two"),
                                         ("--exit_threshold", "1.5"), ("--updater_norm_pre_mlp", "maybe")])
def test_bad_tah2_config_values_name_the_field(data, tmp_path, capsys, flag, value):
    assert train_main(_argv(data, tmp_path / "bad", flag, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    field = flag.lstrip("-").replace("-", "_")
    assert err.startswith("error: ") and f"TaH2Config.{field}" in err, err
    assert not (tmp_path / "bad").exists()  # rejected before any data or weights are loaded


# 3. `none` for optional fields; padding-free training

def test_none_sets_optional_trainer_fields_to_none(tmp_path):
    cfg = train_tah2.trainer_config
    out = str(tmp_path)
    assert cfg({}, ["--use_cpu", "true", "--max_length", "none"], out, False).max_length is None
    assert cfg({}, ["--use_cpu", "true", "--max-length", "NULL"], out, False).max_length is None
    assert cfg({"max_length": None}, ["--use_cpu", "true"], out, False).max_length is None  # `max_length: null`
    assert cfg({}, ["--use_cpu", "true", "--max_length", "64"], out, False).max_length == 64
    clamp = cfg({}, ["--use_cpu", "true", "--beta_clamp_min", "none", "--beta_clamp_max", "none"], out, False)
    assert clamp.beta_clamp is None
    assert cfg({}, ["--use_cpu", "true", "--report_to", "none"], out, False).report_to in ([], "none", ["none"])


def test_padding_free_training_runs_with_max_length_none(data, tmp_path):
    trainer = train_run(_argv(data, tmp_path / "pf", "--padding_free", "true", "--max_length", "none",
                              "--per_device_train_batch_size", "2", "--iteration_attention", "same_iter"))
    assert trainer.args.padding_free and trainer.args.max_length is None
    assert trainer.model.config.iteration_attention == "same_iter"
    losses = _losses(trainer)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


# 4. Trainer checkpoints carry the remote code



@pytest.mark.slow
def test_trainer_checkpoints_load_with_remote_code_without_hf_loops(data, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train_run(_argv(data, out, "--save_strategy", "steps", "--save_steps", "1"))
    final_cfg = json.load(open(out / "config.json"))
    code = {f for f in os.listdir(out) if f.endswith(".py")}
    assert {"modeling_tah2.py", "configuration_tah2.py", "loop_utils.py"} <= code
    for step in (1, 2):
        ckpt = out / f"checkpoint-{step}"
        cfg = json.load(open(ckpt / "config.json"))
        assert cfg["auto_map"] == final_cfg["auto_map"]
        assert code <= set(os.listdir(ckpt))
        for f in code:
            assert (ckpt / f).read_text() == (out / f).read_text()
    # The classes are not left registered: later plain saves stay plain.
    from hf_loops import TaH2Config, TaH2ForCausalLM

    assert TaH2Config._auto_class is None and TaH2ForCausalLM._auto_class is None

    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    res = subprocess.run([sys.executable, str(script), str(out / "checkpoint-2"), str(tmp_path / "ids.pt"),
                          str(tmp_path / "logits.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    final = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # the same weights as step 2
    with torch.no_grad():
        want = final(ids).logits
    assert (torch.load(tmp_path / "logits.pt") - want).abs().max() <= 1e-5


# 5. Truncation that leaves no completion token

def test_truncation_drops_examples_without_completion_tokens(data, tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    rows = [_qa(i) for i in range(6)]
    for i in (6, 7):  # prompts of ~96 tokens: nothing of the answer fits in 40 tokens
        rows.append({"question": "Please think very carefully about this question. " * 2 + _qa(i)["question"],
                     "answer": _qa(i)["answer"]})
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = _argv(data, tmp_path / "mixed", "--max_length", "40", "--max_steps", "1")
    argv[argv.index("--dataset") + 1] = str(mixed)
    trainer = train_run(argv)
    assert len(trainer.train_dataset) == 6
    err = capsys.readouterr().err
    assert "dropped 2 of 8 train examples" in err and "max_length=40" in err
    assert all(any(x != -100 for x in row) for row in trainer.train_dataset["labels"])

    # Nothing left: a ValueError that says why (exit code 2), instead of TRL's num_samples=0.
    assert train_main(_argv(data, tmp_path / "none", "--max_length", "16")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "truncation at max_length=16 removed every completion token from all 8 train examples" in last
    assert "--max_length" in last.split("examples", 1)[1]


# 6. Official layout: float config values round-trip exactly

def test_official_export_round_trips_float_config_values_exactly(tmp_path):
    from hf_loops.conversion.tah2_official import export_tah2, import_tah2

    rng = random.Random(0)
    for i, tau in enumerate([0.3, 0.1 + 0.2] + [rng.uniform(0.01, 0.99) for _ in range(3)]):
        qwen = {"rms_norm_eps": rng.uniform(1e-7, 1e-5), "initializer_range": rng.uniform(1e-3, 0.1),
                "attention_dropout": rng.random(),
                "rope_parameters": {"rope_type": "default", "rope_theta": rng.uniform(1e3, 1e6)}}
        model = tiny_tah2(seed=i, qwen_overrides=qwen, exit_threshold=tau)
        loaded = import_tah2(export_tah2(model, tmp_path / f"official{i}"))
        assert loaded.config.exit_threshold == tau  # bit-identical, not 0.30000001
        want, got = model.config.to_dict(), loaded.config.to_dict()
        for key, value in want.items():
            if isinstance(value, float) or key == "rope_parameters":
                assert got[key] == value, key


def test_threshold_buffer_of_lower_precision_reads_as_its_shortest_decimal():
    from hf_loops.modeling.tah2_official import threshold_value

    assert threshold_value(torch.tensor(0.3)) == 0.3  # a float32 buffer holds 0.30000001192…
    assert threshold_value(torch.tensor(0.3, dtype=torch.bfloat16)) == 0.3
    assert threshold_value(torch.tensor(0.1 + 0.2, dtype=torch.float64)) == 0.1 + 0.2
    assert threshold_value(torch.tensor(0.3), declared=0.3) == 0.3
    assert threshold_value(torch.tensor(0.5), declared=0.3) == 0.5  # the buffer wins when they disagree


# 7. Failures: one last line on stderr, --debug for the traceback

@pytest.mark.slow
def test_training_failure_is_the_last_stderr_line(data, tmp_path, capsys, monkeypatch):
    from hf_loops.cli import main as cli_main
    from hf_loops.training.tah2_trainer import TaH2SFTTrainer

    def boom(self, *args, **kwargs):
        raise RuntimeError("CUDA went away\nout of memory on step 1")

    monkeypatch.setattr(TaH2SFTTrainer, "compute_loss", boom)
    argv = [a for a in _argv(data, tmp_path / "fail") if a not in ("--disable_tqdm", "true")]  # keep the bar
    assert cli_main(["train", *argv]) == 1
    err = capsys.readouterr().err
    assert "%|" in err  # a progress bar was drawn before the failure
    last = err.split("\n")[-2]  # the bar redraws with \r: the failure must start a line of its own
    assert last == "RuntimeError: out of memory on step 1 (rerun with --debug for the traceback)", err[-500:]
    assert err.endswith("\n") and "Traceback" not in err

    with pytest.raises(RuntimeError, match="out of memory"):
        cli_main(["train", *argv, "--debug"])
    with pytest.raises(ValueError, match="recipe"):
        train_main(_argv(data, tmp_path / "x", "--recipe", "nope", "--debug"))
    assert train_main(_argv(data, tmp_path / "x", "--recipe", "nope")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --recipe")


# --save_steps against the recipe's save_strategy

def test_save_steps_over_a_recipe_that_saves_nothing_saves_as_asked(data, tmp_path, capsys):
    """tiny-cpu says save_strategy "no"; `--save_steps 1` on the command line (or from Python) is a request for
    checkpoints: saved every step, said in one line. Beside an explicit `--save_strategy no` it is ignored, said too."""
    from hf_loops.training.checkpoints import complete_checkpoints

    out = tmp_path / "asked"
    assert train_main(_argv(data, out, "--save_steps", "1")) == 0
    assert [os.path.basename(p) for p in complete_checkpoints(str(out))] == ["checkpoint-1", "checkpoint-2"]
    note = ("note: saving a checkpoint every 1 steps as --save_steps asks (the recipe's save_strategy 'no' becomes "
            "'steps')")
    assert note in capsys.readouterr().err.splitlines()
    out = tmp_path / "told"
    assert train_main(_argv(data, out, "--save-strategy=no", "--save_steps", "1")) == 0
    assert complete_checkpoints(str(out)) == []
    assert "note: --save_steps 1 is ignored: save_strategy is 'no' (no checkpoints are saved)" in \
        capsys.readouterr().err.splitlines()


def test_save_schedule_words():
    """Which trainer words `save_schedule` adds: only for --save_steps over a recipe's "no", from either source."""
    from hf_loops.training.train_tah2 import save_schedule

    no = {"save_strategy": "no"}
    assert save_schedule(no, ["--save_steps", "5"], {}) == ["--save_strategy", "steps"]
    assert save_schedule(no, ["--save-steps=5"], {}) == ["--save_strategy", "steps"]
    assert save_schedule(no, [], {"save_steps": 5}) == ["--save_strategy", "steps"]  # train(trainer={...})
    assert save_schedule(no, [], {}) == []  # not asked: the recipe's "no" stands
    assert save_schedule({"save_steps": 500}, ["--save_steps", "5"], {}) == []  # the recipe saves anyway
    assert save_schedule(no, ["--save_steps", "5", "--save_strategy", "epoch"], {}) == []  # the user's own choice
