"""The demo's knobs: the training settings its runs share (`HOP_TRAINING`, `DEMO_TRAINING`, `ARITHMETIC_TRAINING`), the
tasks' sizes, seeds and run names, and the typed settings that travel between the pipeline and its worker processes:
`RunJob` (one post-train + evaluate run), `HopOptions` (`hf-loops demo --task hop`, what `make demo` runs) and
`ArithmeticOptions` (the arithmetic part of `hf-loops demo --task both`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..data.hop_task import HopTaskSpec
from ..evaluation.metrics import DEFAULT_MAX_NEW_TOKENS
from ..evaluation.tasks import HopTaskRun

# The settings both runs share (TaH2SFTConfig fields). Sized so the whole demo fits in 5 minutes on 2 CPU cores.
DEMO_TRAINING = {
    # 10 steps (was 20) to fit make demo's CPU budget; validation (the last 10 of the 80 training problems held out,
    # seed 0) says it costs answer NLL: Standard 2.468 vs 2.420 at 20 steps, TaH2 2.470 vs 2.456.
    "max_steps": 10,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 2,
    "per_device_train_batch_size": 8,
    "max_length": 384,
    "weight_decay": 0.01,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    # α_D (TaH2 only; inert for Standard, which has no decider). The paper's 0.05 collapses the decider at this scale:
    # the fresh updater's depth-2 predictions are poor at first, the NTP gradient through the mixture pushes every g
    # below τ within two steps (measured: mean depth 1.000 from step 3 on, never recovering), and with no token
    # continuing the updater gets no NTP gradient to improve. 1.0 lets the lookahead labels hold the decider up.
    "decider_loss_weight": 1.0,
}

DEMO_HELDOUT = 20
# the held-out reference answers are 52-248 tokens long: 192 leaves room for most of them
DEMO_MAX_NEW_TOKENS = DEFAULT_MAX_NEW_TOKENS
DEMO_TASKS = ("hop", "both", "arithmetic", "gsm8k")


def arch_label(preset: str, max_iterations: int = 2) -> str:
    """A demo run's name in tables, from the architecture registry's display name of its TaH2 preset (the preset's
    fields over TaH2Config's defaults, at the demo's M): "Standard (M=1)", "TaH2 (M=2)", "TaH2-fixed (M=2)"."""
    from types import SimpleNamespace

    from ..conversion.registry import ARCHITECTURES
    from ..modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config

    fields = {"max_iterations": max_iterations, "decider": TaH2Config().decider, **TAH2_PRESETS[preset]}
    return ARCHITECTURES["tah2"].display(SimpleNamespace(**fields))



RUNS = (("standard", arch_label("standard")), ("tah2", arch_label("tah2")))  # the GSM8K runs
ARCHS = tuple((a, arch_label(a)) for a in ("standard", "tah2", "tah2-fixed"))
ARITHMETIC_SEEDS = (0, 1, 2)
ARITHMETIC_SIZES = {"n_train": 2000, "n_validation": 40, "n_heldout": 40}
ARITHMETIC_DATA_SEED = 0
ARITHMETIC_MAX_NEW_TOKENS = 80

# Shared by every run (TaH2SFTConfig fields); on top of the GSM8K demo's settings (`DEMO_TRAINING`).
# Chosen on the validation split (examples/arithmetic_sweep.py); departures from the paper are listed in the report.
ARITHMETIC_TRAINING = {
    # 40 steps (was 60) to fit make demo's CPU budget; on the validation split (seed 0) it costs answer NLL:
    # Standard 1.272 vs 1.239 at 60 steps, TaH2 1.289 vs 1.252 (TaH2 - Standard +0.017 vs +0.013).
    "max_steps": 40,
    "max_length": 160,
    "logging_steps": 10,
    # The authors' threshold warm-up (τ from ~0 over the first third): validation answer NLL 1.283 vs 1.295 without
    # (one seed, lr 3e-3, 60 steps); inert for Standard and TaH2-fixed, which have no learned decider.
    "base_warmup_steps": 13,
}


# The depth-bound task (`hf_loops.data.hop_task`, what `make demo` runs): 2-hop lookup over 8 letter pairs, 4 queries.
# The base (`hf_loops.data.hop_base_dir()`) was pretrained on 1-hop problems only (train split, data seed 0); the
# post-training problems are train-split problems of data seed 1 with 1 and 2 hops; the recipe was chosen on the
# validation split (data seed 0, experiments/depth_bound/README.md); the held-out problems are the test split.
HOP_SPEC = HopTaskSpec(n_sym=8, n_queries=4, max_hops=2)
HOP_SEEDS = (0, 1, 2)
HOP_TRAIN_DATA_SEED = 1
HOP_HELDOUT_DATA_SEED = 0
HOP_SIZES = {"n_heldout": 500}
HOP_EVAL_BATCH = 250  # held-out problems per evaluation batch (72 tokens each)
# The looped runs' model fields (TaH2 and TaH2-fixed alike). The `topk_embedding` updater (TaH v1: pass 2's input is
# the probability-weighted embedding of pass 1's top-k prediction) instead of the paper's Eq. 9 learned updater: a
# second hop is the same lookup run on pass 1's answer, which this updater hands to pass 2 as its input token. On the
# validation split (TaH2, α_D 3, 120 steps, seed 0) the learned updater gives 8.2 % exact match (2-hop letters
# 12.1 %, none of them sent deep), the top-k updater 100.0 %.
HOP_MODEL = {"max_iterations": 2, "updater": "topk_embedding"}
HOP_TRAINING = {
    # 120 steps x 64 problems: on the validation split TaH2 (α_D 3, seed 0) reaches 15.4 % exact match at 60 steps,
    # 92.2 % at 90, 100.0 % at 120 (seeds 1, 2: 96.6, 99.0 %); 300 steps do not fit make demo's 8 minutes for 9 runs
    "max_steps": 120,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "per_device_train_batch_size": 64,
    "max_length": 96,  # a prompt and answer are 72 tokens with the character tokenizer
    "weight_decay": 0.01,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 10,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    # α_D, chosen on the validation split (TaH2, 120 steps, seed 0 / 1 / 2): 1.0 gives 97.8 / 98.8 / 94.0 % exact match
    # with 38 / 38 / 25 % of copy tokens deep; 3.0 gives 100.0 / 96.6 / 99.0 % with 26 / 13 / 26 %; 6.0 (seed 0)
    # 93.0 % with 26 %. The paper's 0.05 collapses the decider at this scale (see DEMO_TRAINING).
    "decider_loss_weight": 3.0,
    # the authors' threshold warm-up (τ from ~0 over the first third of the steps); inert for Standard and TaH2-fixed.
    # Validation (α_D 1, seed 0): without it 7.4 % exact match (2-hop letters 12.1 %, all of them deep: the second
    # pass never learns the hop), over the first sixth 88.8 %, over the first third 97.8 %.
    "base_warmup_steps": 40,
}


def _check_steps(steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be an integer >= 1, got {steps!r}")


def _merge(base: dict, steps: int | None, training: dict | None, progress: bool) -> dict:
    settings = {**base, **({} if progress else {"disable_tqdm": True}), **(training or {})}
    if steps is not None:
        _check_steps(steps)
        settings["max_steps"] = steps
    return settings


def arithmetic_settings(steps: int | None = None, training: dict | None = None, progress: bool = False) -> dict:
    return _merge({**DEMO_TRAINING, **ARITHMETIC_TRAINING}, steps, training, progress)


def hop_settings(steps: int | None = None, training: dict | None = None, progress: bool = False) -> dict:
    """`HOP_TRAINING` with `--steps` and overrides; the threshold warm-up stays the first third of the steps."""
    settings = _merge(HOP_TRAINING, steps, training, progress)
    if steps is not None and "base_warmup_steps" not in (training or {}):
        settings["base_warmup_steps"] = round(steps / 3)
    return settings


@dataclass(frozen=True)
class RunJob:
    """One run for `runs.run_jobs`: post-train `arch` from `base` on `train_file` with `settings` (TaH2SFTConfig
    fields) and `seed` into `ckpt`, evaluate it on `heldout`; `keep` the checkpoint or remove it. Plain fields, so it
    travels to a spawned worker process."""

    task: str  # "gsm8k", "arithmetic" or "hop"
    base: str
    arch: str
    seed: int
    settings: dict
    train_file: str
    heldout: str
    ckpt: str
    batch_size: int
    max_new_tokens: int
    max_iterations: int | None = None  # the looped presets' M (None: the preset's own)
    keep: bool = False
    decider_accuracy: bool = False
    name: str | None = None  # the run's name in tables (None: the checkpoint's display name)
    threads: int = 1
    model: dict | None = None  # TaH2Config fields of the looped runs (None: the preset's, with max_iterations)
    # a generated task (None: `heldout` is a file): scored with its answer line and per-token accuracy, and the
    # result gets the task's one-object summary under "summary" (`hf_loops.evaluation.tasks.task_summary`)
    task_run: HopTaskRun | None = None


@dataclass(frozen=True)
class ArithmeticOptions:
    """The arithmetic task's part of a demo run (`arithmetic_task.arithmetic_part`): seeds, training steps and
    TaH2SFTConfig overrides, split sizes (`ARITHMETIC_SIZES` keys), the archs run (None: every one of `ARCHS`)."""

    seeds: tuple[int, ...] = ARITHMETIC_SEEDS
    steps: int | None = None
    training: dict | None = None
    sizes: dict | None = None
    archs: tuple[str, ...] | None = None
    progress: bool = False
    max_new_tokens: int = ARITHMETIC_MAX_NEW_TOKENS


@dataclass(frozen=True)
class HopOptions:
    """`hf-loops demo --task hop`: seeds, training steps and TaH2SFTConfig overrides, the held-out size, the archs run
    (None: every one of `ARCHS`)."""

    seeds: tuple[int, ...] = HOP_SEEDS
    steps: int | None = None
    training: dict | None = None
    n_heldout: int = HOP_SIZES["n_heldout"]
    archs: tuple[str, ...] | None = None
    progress: bool = False
    batch_size: int = HOP_EVAL_BATCH


__all__ = ["ARCHS", "ARITHMETIC_DATA_SEED", "ARITHMETIC_MAX_NEW_TOKENS", "ARITHMETIC_SEEDS", "ARITHMETIC_SIZES",
           "ARITHMETIC_TRAINING", "DEMO_HELDOUT", "DEMO_MAX_NEW_TOKENS", "DEMO_TASKS", "DEMO_TRAINING", "HOP_EVAL_BATCH", "HOP_HELDOUT_DATA_SEED",
           "HOP_MODEL", "HOP_SEEDS", "HOP_SIZES", "HOP_SPEC", "HOP_TRAINING", "HOP_TRAIN_DATA_SEED", "RUNS",
           "ArithmeticOptions", "HopOptions", "RunJob", "arch_label", "arithmetic_settings", "hop_settings"]
