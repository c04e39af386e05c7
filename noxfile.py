"""The compatibility matrix: one session per tested transformers version, each in its own environment.

    nox -l                                   # the sessions
    nox -s "compat(transformers='5.19')"     # one of them (`make test-matrix` runs them all; `-r` reuses envs)

Each session installs the CPU torch build first (`torch==2.13.0`, on local disk: a bare `torch` would pull a CUDA
build), then the session's pinned transformers / TRL / PEFT / accelerate, then hf_loops with its `train,dev` extras
*without* constraints, and checks that pip kept every pinned version: `pip install hf_loops` into an environment that
already holds a supported transformers must not replace it. It then runs the compatibility subset below.

The lowest row carries the lowest versions of TRL, PEFT and accelerate that pyproject.toml declares, the newest row
the newest releases; transformers 5.19 is also the version vLLM's CPU build pins (`make test-vllm` runs its own
environment with the vLLM tests). hf_loops.core.compat.TESTED_TRANSFORMERS and the README list these versions and the main environment's
(`make test`, the Makefile's PINS: the newest tested).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["compat"]

TORCH = "torch==2.13.0"

# transformers minor -> the exact versions the session pins.
MATRIX = {
    # lowest supported transformers (= vLLM 0.32's pin, <5.20), with the lowest declared TRL / PEFT / accelerate
    "5.19": {"transformers": "5.19.0", "trl": "1.16.0", "peft": "0.21.0", "accelerate": "1.10.1"},
    # a middle one
    "5.22": {"transformers": "5.22.2", "trl": "1.16.0", "peft": "0.21.2", "accelerate": "1.16.0"},
    # the newest before 5.25 (whose serving moved models into processes of their own), newest of the rest; 5.25.0
    # itself is the main environment's (`make test`, the Makefile's PINS)
    "5.24": {"transformers": "5.24.0", "trl": "1.16.0", "peft": "0.21.2", "accelerate": "1.16.0"},
}

# The compatibility subset (~2 min on 2 cores): the import guard and cache helpers; transformers' own common model
# tests on TaH2 (M = 1, 2), SpiralFormer and SGT; TaH2 forward / cache / generate; the ecosystem paths (PEFT,
# checkpointing, TP plans, assisted decoding); convert -> save -> reload (package and remote code) -> generate; TRL:
# TaH2SFTTrainer runs (30 steps, resume, LoRA merge) whose checkpoints load by remote code and generate, TRL's stock
# trainers on our models; transformers' continuous batching (`generate_batch` == `generate`) for SGT and TaH2.
SUBSET = [
    "tests/core/test_compat.py",
    "tests/modeling/test_transformers_common.py",
    "tests/modeling/test_tah2.py",
    "tests/modeling/test_ecosystem_paths.py",
    "tests/conversion/test_conversion.py",
    "tests/conversion/test_tah2_export.py",
    "tests/training/test_tah2_training.py",
    "tests/training/test_trl_stock_trainers.py",
    "tests/training/test_train_cli.py",
    "tests/serving/test_continuous_batching.py",
]

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

CHECK_KEPT = """
import sys
from importlib.metadata import version
pins = dict(arg.split("==") for arg in sys.argv[1:])
changed = {name: (pin, version(name)) for name, pin in pins.items() if version(name).split("+")[0] != pin}
if changed:
    sys.exit("pip install hf_loops replaced pinned packages: " +
             ", ".join(f"{n} {pin} -> {now}" for n, (pin, now) in changed.items()))
print("kept: " + ", ".join(f"{n}=={version(n)}" for n in pins))
"""


@nox.session
@nox.parametrize("transformers", list(MATRIX))
def compat(session: nox.Session, transformers: str) -> None:
    pins = [f"{name}=={v}" for name, v in MATRIX[transformers].items()]
    session.install(TORCH)
    session.install(*pins)
    session.install("-e", ".[train,dev]")
    session.run("python", "-c", CHECK_KEPT, TORCH, *pins)
    session.run("python", "-m", "pip", "check")
    # transformers' common tests for *this* version (its sdist, cached outside the repository per version)
    session.run("python", "tests/fetch_transformers_tests.py")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not multiprocess", "-n", "auto",
                "--dist", "loadscope", *SUBSET, *session.posargs, env=OFFLINE)
