"""Training checkpoints are complete or absent: a run killed while saving `checkpoint-N` loses at most that one,
`--resume-from-checkpoint true` picks the newest COMPLETE checkpoint and resumes to the weights of an uninterrupted
run; two runs cannot share one output directory (the second is refused at once, the first is untouched)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: F401  (the `data` fixture)
from safetensors.torch import load_file

from hf_loops.core.outdir import TMP_PREFIX, lock_path
from hf_loops.training.checkpoints import complete_checkpoints, last_complete_checkpoint
from hf_loops.training.train_tah2 import main as train_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTDIR = os.path.join(REPO, "hf_loops", "core", "outdir.py")
STEPS = ["--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1"]

# A child `hf-loops train` that is SIGKILL-ed in the middle of saving checkpoint-KILL_AT: after the weights, before the
# RNG state and trainer_state.json (what the Trainer writes last).
KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from transformers import Trainer
    real = Trainer._save_rng_state

    def save_rng_state(self, output_dir):
        if self.state.global_step == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, output_dir)

    Trainer._save_rng_state = save_rng_state
    from hf_loops.training.train_tah2 import main
    sys.exit(main(sys.argv[1:]))
""")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO)


def _weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow
def test_kill_during_a_save_then_resume_gives_the_uninterrupted_weights(data, tmp_path, capsys):
    whole = tmp_path / "whole"
    assert train_main(_argv(data, whole, *STEPS)) == 0
    assert [os.path.basename(p) for p in complete_checkpoints(str(whole))] == [f"checkpoint-{i}" for i in (1, 2, 3)]

    run = tmp_path / "killed"
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(repo=REPO, kill_at=2))
    res = subprocess.run([sys.executable, str(script), *_argv(data, run, *STEPS)], env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    names = sorted(os.listdir(run))
    assert "checkpoint-1" in names and "checkpoint-2" not in names, names  # the interrupted save is not visible
    assert any(n.startswith(TMP_PREFIX) for n in names)  # its staging folder is (a dead process's leftover)
    assert last_complete_checkpoint(str(run)).endswith("checkpoint-1")

    capsys.readouterr()
    assert train_main(_argv(data, run, *STEPS, "--resume-from-checkpoint", "true")) == 0
    names = sorted(os.listdir(run))
    assert not [n for n in names if n.startswith(TMP_PREFIX)], names  # the leftover was removed
    assert {"checkpoint-2", "checkpoint-3", "model.safetensors"} <= set(names)
    a, b = _weights(whole), _weights(run)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), key  # bit-identical to the uninterrupted run


def test_resume_true_skips_incomplete_checkpoints_and_names_them(tmp_path):
    run = tmp_path / "run"
    for step, complete in ((1, True), (2, True), (3, False)):
        folder = run / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(run)) == str(run / "checkpoint-2")
    (run / "checkpoint-1" / "trainer_state.json").unlink()
    (run / "checkpoint-2" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"no complete checkpoint-N in .*checkpoint-1, checkpoint-2, checkpoint-3 "
                                         r"lack trainer_state\.json"):
        last_complete_checkpoint(str(run))


def test_a_second_run_into_the_same_directory_is_refused_while_the_first_runs(data, tmp_path, capsys):
    from hf_loops.core.outdir import output_lock

    out = tmp_path / "shared"
    holder = textwrap.dedent(f"""
        import sys, time
        import importlib.util
        # the stdlib-only module, loaded by path: no torch/transformers import in this process
        spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
        outdir = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(outdir)
        output_lock = outdir.output_lock
        with output_lock({str(out)!r}, "--output-dir"):
            print("locked", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert train_main(_argv(data, out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (f"error: --output-dir {str(out)!r} is being written by another run (pid {proc.pid}); wait "
                           "for it to finish or choose another directory"), err
        assert not out.exists()  # nothing written by the refused run
    finally:
        proc.kill()
        proc.wait()
    with output_lock(str(out)):  # released with its process (fcntl locks die with their holder)
        pass
    assert not os.path.exists(lock_path(str(out)))


@pytest.mark.slow
def test_resuming_a_standard_run_as_tah2_names_the_settings(data, tmp_path, capsys):
    run = tmp_path / "std"
    assert train_main(_argv(data, run, "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1",
                            arch="standard")) == 0
    capsys.readouterr()
    assert train_main(_argv(data, run, "--resume-from-checkpoint", "true")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was trained with other loop settings" in last and "max_iterations=1 in the checkpoint, 2 in this run" \
        in last, last
