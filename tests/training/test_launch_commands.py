"""The multi-process commands of docs/tah2.md, run as written on 2 CPU processes (gloo): DDP, FSDP2 through the
Trainer's `--fsdp` flags, and FSDP2 from the accelerate config file shown there. Each launch trains a tiny base for one
step with a checkpoint, then `--resume-from-checkpoint true` trains the second step; the result loads and equals one
process on the same global batch (the 2 ranks' per-device batch of 2 = one process's batch of 4). Under every launch
the output lock is the run's (rank 0 holds it, rank 1 waits for it), and a second run into a locked directory is
still refused.

The commands come from the docs themselves (the placeholders BASE, DATA and OUT replaced, a free rendezvous port and
the tiny run's step, checkpoint and threshold options added), so the docs and this test cannot drift apart."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from helpers.train_cli_helpers import tiny_train_setup  # noqa: F401  (the `data` fixture)
from safetensors.torch import load_file

from hf_loops.core.outdir import lock_path
from hf_loops.training.checkpoints import complete_checkpoints
from hf_loops.training.train_tah2 import main as train_main

pytestmark = pytest.mark.multiprocess  # two ranks at once: make test runs these after the parallel run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "tah2.md")
OUTDIR = os.path.join(REPO, "hf_loops", "core", "outdir.py")
# What the tiny run adds to the documented command: its tokenizer, one logged step per optimizer step, τ = 0.05 (nearly
# every token continues, so the lookahead and the depth-2 pass run on both ranks), no progress bars.
TINY = ["--logging_steps", "1", "--exit-threshold", "0.05", "--disable_tqdm", "true"]


def documented_commands() -> dict[str, str]:
    """The `accelerate launch` commands of docs/tah2.md's multi-process block, continuation lines joined, by kind:
    "ddp" (2 processes), "fsdp" (2 processes with --fsdp), "config" (--config_file fsdp2.yaml); and "yaml": the
    fsdp2.yaml the docs show."""
    text = open(DOC, encoding="utf-8").read()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    found = {}
    for lang, body in blocks:
        if lang == "yaml" and "distributed_type: FSDP" in body:
            found["yaml"] = body
        if lang != "bash" or "accelerate launch" not in body:
            continue
        commands, current = [], ""
        for line in body.splitlines():
            if not current and (not line.strip() or line.lstrip().startswith("#")):
                continue
            current += line + "\n"
            if current.count("'") % 2 == 0 and not line.rstrip().endswith("\\"):
                commands.append(current.replace("\\\n", " "))
                current = ""
        for command in commands:
            if "--num_processes 2" in command:
                found["fsdp" if "--fsdp " in command else "ddp"] = command
            elif "--config_file fsdp2.yaml" in command:
                found["config"] = command
    assert set(found) == {"ddp", "fsdp", "config", "yaml"}, f"docs/tah2.md lost a documented command: {sorted(found)}"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """No accelerate or torch.distributed variables from this process; one thread per rank."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1", **extra)
    return env


def as_run(command: str, data, out, config_file: str, *extra: str) -> list[str]:
    """The documented command as an argv: `accelerate` is this Python's accelerate, BASE/DATA/OUT the tiny paths."""
    words = shlex.split(command)
    assert words[:2] == ["accelerate", "launch"], words
    where = {"BASE": data["base"], "DATA": data["train"], "OUT": str(out), "fsdp2.yaml": config_file}
    words = [where.get(w, w) for w in words[2:]]
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words,
            "--tokenizer", data["tokenizer"], *TINY, *extra]


def launch(argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def failed(res) -> str:
    lines = [line for line in res.stderr.splitlines() if "rror" in line or line.startswith("error")]
    return "\n".join(lines[-30:]) or res.stderr[-3000:]


def logged(run_dir, step: int) -> dict:
    with open(os.path.join(run_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return next(h for h in history if h.get("step") == step and "ntp_loss" in h)


@pytest.fixture(scope="module")
def fsdp2_yaml(tmp_path_factory):
    """The docs' fsdp2.yaml as a file."""
    path = tmp_path_factory.mktemp("accelerate") / "fsdp2.yaml"
    config = yaml.safe_load(documented_commands()["yaml"])
    assert config["num_processes"] == 2 and config["fsdp_config"]["fsdp_version"] == 2
    path.write_text(documented_commands()["yaml"])
    return str(path)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The reference: one process, the 2 ranks' union batch (4), both steps without a break."""
    out = tmp_path_factory.mktemp("one") / "run"
    argv = ["--base", data["base"], "--tokenizer", data["tokenizer"], "--dataset", data["train"], "--output-dir",
            str(out), "--recipe", "tiny-cpu", "--max_steps", "2", "--per_device_train_batch_size", "4", *TINY]
    assert train_main(argv) == 0
    return out


def run_documented(kind, data, tmp_path, fsdp2_yaml):
    """Step 1 with a checkpoint, then the resumed step 2, both through the documented command; returns the run dir."""
    command = documented_commands()[kind]
    out = tmp_path / "run"
    first = launch(as_run(command, data, out, fsdp2_yaml, "--max_steps", "1", "--save_steps", "1"))
    assert first.returncode == 0, failed(first)
    assert [os.path.basename(p) for p in complete_checkpoints(str(out))] == ["checkpoint-1"]
    assert not os.path.exists(lock_path(str(out)))  # released by rank 0 when the run ended
    second = launch(as_run(command, data, out, fsdp2_yaml, "--max_steps", "2", "--save_steps", "1",
                           "--resume-from-checkpoint", "true"))
    assert second.returncode == 0, failed(second)
    assert [os.path.basename(p) for p in complete_checkpoints(str(out))] == ["checkpoint-1", "checkpoint-2"]
    with open(out / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == 2
    # one writer: the run records once, every rank's RNG state in each checkpoint
    assert sorted(n for n in os.listdir(out / "checkpoint-2") if n.startswith("rng_state")) == \
        ["rng_state_0.pth", "rng_state_1.pth"]
    return out, first, second


def check_equals_one_process(out, one_process):
    """The 2-rank, resumed run == one process on the union batch: the step-2 losses and the final weights."""
    from transformers import AutoModelForCausalLM

    a, b = logged(out, 2), logged(one_process, 2)
    for key in ("ntp_loss", "decider_loss", "mean_depth", "label_continue_rate@1"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    ours, ref = load_file(out / "model.safetensors"), load_file(one_process / "model.safetensors")
    assert set(ours) == set(ref)
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 1e-5, worst
    model = AutoModelForCausalLM.from_pretrained(out)  # what a user does next
    assert type(model).__name__ == "TaH2ForCausalLM"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def check_remote_code(folder):
    """A checkpoint's remote code is hf_loops' modeling files, never torch's FSDP module (FSDP2 swaps the class)."""
    with open(os.path.join(folder, "config.json")) as f:
        auto_map = json.load(f)["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_tah2.TaH2ForCausalLM", auto_map
    assert not [n for n in os.listdir(folder) if n.startswith("_fsdp")]


@pytest.mark.slow
def test_ddp_launch_command(data, tmp_path, fsdp2_yaml, one_process):
    out, first, _ = run_documented("ddp", data, tmp_path, fsdp2_yaml)
    assert "being written by another run" not in first.stderr
    assert not os.path.exists(out / "checkpoint-1" / "pytorch_model_fsdp.bin")  # DDP: one plain model file
    check_remote_code(out / "checkpoint-1")
    check_equals_one_process(out, one_process)


@pytest.mark.slow
def test_fsdp_flags_launch_command(data, tmp_path, fsdp2_yaml, one_process):
    out, _, _ = run_documented("fsdp", data, tmp_path, fsdp2_yaml)
    assert os.path.isfile(out / "checkpoint-1" / "pytorch_model_fsdp.bin")  # accelerate's FSDP model state: sharded
    check_remote_code(out / "checkpoint-1")
    check_remote_code(out)
    check_equals_one_process(out, one_process)


@pytest.mark.slow
def test_fsdp2_config_file_launch_command(data, tmp_path, fsdp2_yaml, one_process):
    out, _, _ = run_documented("config", data, tmp_path, fsdp2_yaml)
    assert os.path.isfile(out / "checkpoint-1" / "pytorch_model_fsdp.bin")
    check_remote_code(out / "checkpoint-2")
    check_equals_one_process(out, one_process)


def test_a_launch_into_a_directory_another_run_writes_is_refused(data, tmp_path, fsdp2_yaml):
    """A separate run holds the lock: the launch's rank 0 is refused in one line, nothing is written, and its other
    rank (waiting for its own run's lock) is stopped with it."""
    out = tmp_path / "taken"
    holder = textwrap.dedent(f"""
        import importlib.util, time
        spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
        outdir = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(outdir)
        with outdir.output_lock({str(out)!r}, "--output-dir"):
            print("locked", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        res = launch(as_run(documented_commands()["ddp"], data, out, fsdp2_yaml, "--max_steps", "1"), timeout=120)
        assert res.returncode != 0
        assert (f"error: --output-dir {str(out)!r} is being written by another run (pid {proc.pid}); wait for it to "
                "finish or choose another directory") in res.stderr.splitlines()
        assert not out.exists()
    finally:
        proc.kill()
        proc.wait()
