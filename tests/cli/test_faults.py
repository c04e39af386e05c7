"""Faults in the middle of a command (a full disk): exit code 2 and one line, nothing half-written, no temporary folder
left, an earlier result intact."""

import errno
import os

import pytest
from helpers.eval_helpers import tiny_base, write_problems
from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: F401  (the `data` fixture)

from hf_loops.core.outdir import TMP_PREFIX


def _corpus_dir(folder):
    """A tiny stand-in for the pretraining corpus, from the vendored GSM8K text."""
    from hf_loops.data import load_gsm8k

    folder.mkdir()
    rows = load_gsm8k()
    for name, field in (("shakespeare.txt", "question"), ("python_docs.txt", "answer")):
        (folder / name).write_text("\n".join(r[field] for r in rows))
    return str(folder)


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _leftovers(folder):
    return [n for n in os.listdir(folder) if n.startswith(".")]


def _last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_eval_on_a_full_disk_keeps_nothing(tmp_path, monkeypatch, capsys):
    from hf_loops.evaluation import report
    from hf_loops.evaluation.cli import main

    base, data = tiny_base(tmp_path / "base"), write_problems(tmp_path / "p.jsonl", n=2)
    monkeypatch.setattr(report, "write_pictures", _full_disk)
    out = tmp_path / "ev"
    assert main([base, "--dataset", data, "--max-new-tokens", "2", "--out", str(out), "--no-progress"]) == 2
    assert _last_line(capsys) == "error: No space left on device"
    assert not out.exists() and _leftovers(tmp_path) == []


def test_pretrain_on_a_full_disk_keeps_the_earlier_result(tmp_path, monkeypatch, capsys):
    from transformers import PreTrainedModel

    from hf_loops.data import default_base_dir
    from hf_loops.training.pretrain_base import cli

    out = tmp_path / "base_out"
    out.mkdir()
    (out / "earlier.txt").write_text("kept")
    real_save = PreTrainedModel.save_pretrained

    def half_written(self, folder, *args, **kwargs):
        real_save(self, folder, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "model.safetensors"))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_written)
    argv = ["--corpus", _corpus_dir(tmp_path / "corpus"), "--max-chars", "4000", "--tokenizer", default_base_dir(),
            "--hidden-size", "16", "--intermediate-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--warmup", "0",
            "--eval-every", "0", "--eval-tokens", "17", "--sample-tokens", "0", "--no-progress", "--out", str(out),
            "--overwrite"]
    assert cli(argv) == 2
    assert _last_line(capsys).endswith("model.safetensors: No space left on device")
    assert os.listdir(out) == ["earlier.txt"] and _leftovers(tmp_path) == []  # the earlier result is intact


@pytest.mark.parametrize("at_step", [2])
@pytest.mark.slow
def test_train_full_disk_during_a_checkpoint_loses_only_that_checkpoint(data, tmp_path, monkeypatch, capsys, at_step):
    from transformers import Trainer

    from hf_loops.training.train_tah2 import main

    real = Trainer._save_rng_state

    def save_rng_state(self, output_dir):
        if self.state.global_step == at_step:
            _full_disk()
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", save_rng_state)
    run = tmp_path / "run"
    assert main(_argv(data, run, "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1")) == 2
    assert _last_line(capsys) == "error: No space left on device"
    names = sorted(os.listdir(run))
    # complete; the interrupted one and its staging folder are gone (TRL's README.md model card stays)
    assert [n for n in names if n.startswith("checkpoint")] == ["checkpoint-1"], names
    assert not [n for n in names if n.startswith(TMP_PREFIX)]
    assert os.path.isfile(run / "checkpoint-1" / "trainer_state.json")


# A child `hf-loops train` that receives SIGTERM in the middle of saving checkpoint-2 (after the weights, before the RNG
# state and trainer_state.json): Python's default action ends the process at once, as SIGKILL does.
SIGTERM_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from transformers import Trainer
real = Trainer._save_rng_state

def save_rng_state(self, output_dir):
    if self.state.global_step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, output_dir)

Trainer._save_rng_state = save_rng_state
from hf_loops.training.train_tah2 import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_train_sigterm_during_a_checkpoint_loses_only_that_checkpoint_and_resumes(data, tmp_path, capsys):
    import signal
    import subprocess
    import sys

    from hf_loops.training.checkpoints import last_complete_checkpoint
    from hf_loops.training.train_tah2 import main

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_CHILD.format(repo=repo))
    run = tmp_path / "run"
    steps = ["--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=repo)
    res = subprocess.run([sys.executable, str(script), *_argv(data, run, *steps)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == -signal.SIGTERM, res.stderr[-2000:]
    names = sorted(os.listdir(run))
    assert "checkpoint-1" in names and "checkpoint-2" not in names, names  # no partial checkpoint-2 is visible
    assert last_complete_checkpoint(str(run)).endswith("checkpoint-1")
    capsys.readouterr()
    assert main(_argv(data, run, *steps, "--resume-from-checkpoint", "true")) == 0
    names = sorted(os.listdir(run))
    assert {"checkpoint-2", "checkpoint-3", "model.safetensors"} <= set(names), names
    assert not [n for n in names if n.startswith(TMP_PREFIX)], names  # the dead run's staging folder was removed
