"""Two CPU processes (gloo) through `TaH2SFTTrainer`: an evaluation step of a TaH2 with M = 3 whose ranks want different
depths (the depth passes are agreed over ranks, or the lookahead's collectives hang), and one SFT step with the decoder
layers wrapped by FSDP2 `fully_shard` via the Trainer's FSDP settings, compared with one process on the union batch.
The same step launched by `accelerate launch --config_file` with FSDP2 (the settings come from the environment only)
shards every parameter and trains the same weights; a DDP config file is DDP; an FSDP1, a parameter-offloading or a
multi-process MULTI_CPU config, which CPU processes cannot honour, is refused in one line before anything is loaded."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess  # two ranks at once: make test runs these after the parallel run

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers and helpers
sys.path.insert(0, HERE)


# The accelerate config files a user would write (what `accelerate config` produces), for 2 processes on this machine.
# `main_process_port: 0`: accelerate picks a free port itself. MULTI_GPU with use_cpu false is how accelerate starts
# several gloo processes on a CPU-only machine (its MULTI_CPU launcher needs mpirun).
ACCELERATE_CONFIGS = {
    "ddp": {"distributed_type": "MULTI_GPU", "use_cpu": False},
    "fsdp2": {"distributed_type": "FSDP", "use_cpu": False, "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Qwen3DecoderLayer", "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": False,
        "fsdp_cpu_ram_efficient_loading": False}},
    "fsdp1": {"distributed_type": "FSDP", "use_cpu": False, "fsdp_config": {
        "fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Qwen3DecoderLayer", "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_state_dict_type": "FULL_STATE_DICT"}},
    "multi_cpu": {"distributed_type": "MULTI_CPU", "use_cpu": True},
}
ACCELERATE_CONFIGS["zero3"] = {"distributed_type": "DEEPSPEED", "use_cpu": False, "deepspeed_config": {
    "zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none", "zero3_init_flag": False}}
ACCELERATE_CONFIGS["zero2"] = {**ACCELERATE_CONFIGS["zero3"], "deepspeed_config": {
    **ACCELERATE_CONFIGS["zero3"]["deepspeed_config"], "zero_stage": 2}}
ACCELERATE_CONFIGS["fsdp2_offload"] = {**ACCELERATE_CONFIGS["fsdp2"], "fsdp_config": {
    **ACCELERATE_CONFIGS["fsdp2"]["fsdp_config"], "fsdp_offload_params": True}}


def write_accelerate_config(folder, name):
    import yaml

    config = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": 2, "machine_rank": 0,
              "main_process_port": 0, "mixed_precision": "no", **ACCELERATE_CONFIGS[name]}
    path = os.path.join(str(folder), f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def launch(config_file, modes, out, timeout=240, **extra_env):
    """`accelerate launch --config_file` of the worker on 2 CPU processes, in a clean environment (no accelerate or
    torch.distributed variables left by earlier in-process runs), with a watchdog in the worker; a hang fails here."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               HF_DIST_WATCHDOG_S=str(timeout - 30), **extra_env)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
           os.path.join(HERE, "helpers", "dist_fsdp_worker.py"), modes, str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    errors = [line for line in res.stderr.splitlines() if "Error" in line or "File " in line]
    assert res.returncode == 0, "\n".join(errors[-40:]) or res.stderr[-3000:]


def load_records(out, modes):
    return {f"{mode}{r}": torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for mode in modes for r in (0, 1)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A DDP accelerate config file: evaluation, the Trainer's own FSDP2 settings, and a step with none (DDP)."""
    out = tmp_path_factory.mktemp("dist")
    # "config" before "fsdp": the FSDP state that the Trainer's settings put on accelerate's process-wide singleton
    # would otherwise carry over to the step that has no FSDP settings.
    launch(write_accelerate_config(out, "ddp"), "eval,config,fsdp", out)
    return load_records(out, ("eval", "config", "fsdp"))


@pytest.fixture(scope="module")
def fsdp2_config_ranks(tmp_path_factory):
    """An FSDP2 accelerate config file, and nothing about FSDP in the Trainer's args."""
    out = tmp_path_factory.mktemp("dist_fsdp2")
    launch(write_accelerate_config(out, "fsdp2"), "config", out)
    return load_records(out, ("config",))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, the union batch, no FSDP."""
    from helpers.dist_fsdp_worker import main

    return main("fsdp", str(tmp_path_factory.mktemp("one")))


@pytest.mark.slow
def test_evaluation_step_synchronises_depth_passes_across_ranks(two_ranks):
    r0, r1 = two_ranks["eval0"], two_ranks["eval1"]
    m0, m1 = r0["eval_metrics"], r1["eval_metrics"]
    assert m0["eval_loss"] == m1["eval_loss"] and torch.isfinite(torch.tensor(m0["eval_loss"]))
    # rank 0's tokens run all 3 depths, rank 1's stop after depth 1 (equal token counts): mean depth 2
    assert m0["eval_mean_depth"] == pytest.approx(2.0)
    assert m0["eval_continue_rate@2"] == pytest.approx(1.0)
    assert r0["delta_cut"] == r1["delta_cut"] and r0["beta"] == r1["beta"]  # pooled over ranks
    assert len(r0["delta_cut"]) == 2  # M − 1 = 2 depth decisions were labelled


@pytest.mark.slow
def test_fsdp2_step_matches_one_process_on_the_union_batch(two_ranks, one_process):
    a, b, one = two_ranks["fsdp0"], two_ranks["fsdp1"], one_process
    assert a["wrapped"].startswith("FSDP") and a["sharded_layer"] == "FSDPQwen3DecoderLayer"  # fully_shard applied
    assert a["saved_class"] == "TaH2ForCausalLM"  # rank 0 saves the plain class, not torch's FSDP<Class>
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


def check_same_step_as_one_process(a, b, one):
    """Two ranks' records of one SFT step on half the batch each == one process on the union batch."""
    assert torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), one["input_ids"])
    assert a["num_items_in_batch"] == b["num_items_in_batch"] == one["num_items_in_batch"]
    assert a["loss"] + b["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert a["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)
    assert set(a["weights"]) == set(one["weights"])
    for key, value in one["weights"].items():
        assert (a["weights"][key] - value).abs().max() <= 1e-5, key


@pytest.mark.slow
def test_fsdp2_accelerate_config_file_shards_every_parameter(fsdp2_config_ranks, one_process):
    a, b = fsdp2_config_ranks["config0"], fsdp2_config_ranks["config1"]
    for rank in (a, b):
        assert rank["distributed_type"] == "DistributedType.FSDP" and rank["wrapped"] == "FSDPTaH2ForCausalLM"
        assert rank["parameters"] > 0 and rank["sharded"] == rank["parameters"]  # every parameter is a DTensor shard
        assert rank["local_elements"] < rank["full_elements"]
    assert a["local_elements"] + b["local_elements"] == a["full_elements"]  # the two shards partition the model
    check_same_step_as_one_process(a, b, one_process)  # the run the --fsdp flags give (see the test above)


def test_ddp_accelerate_config_file_is_ddp(two_ranks, one_process):
    a, b = two_ranks["config0"], two_ranks["config1"]
    for rank in (a, b):
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU" and rank["wrapped"] == "DistributedDataParallel"
        assert rank["sharded"] == 0 and rank["local_elements"] == rank["full_elements"]
    check_same_step_as_one_process(a, b, one_process)


def launcher_environment(config_file):
    """The environment `accelerate launch --config_file` gives each process, from accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", config_file,
                                                                                    "x.py"]))
    if args.use_deepspeed and not args.cpu:  # the branches `launch_command` takes
        from accelerate.utils.launch import prepare_deepspeed_cmd_env

        args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config) if defaults else []
        return prepare_deepspeed_cmd_env(args)[1]
    if (args.use_fsdp or args.multi_gpu) and not args.cpu:
        return prepare_multi_gpu_env(args)  # (torchrun adds its rank variables; the refusals come before any use)
    return prepare_simple_launcher_cmd_env(args)[1]


@pytest.mark.parametrize("name, message", [
    ("fsdp1", "fsdp_version 1 from the accelerate config cannot run on CPU processes"),
    ("fsdp2_offload", "fsdp_offload_params (cpu_offload) from the accelerate config cannot run on CPU processes"),
    ("multi_cpu", "accelerate launch started one"),
])
def test_accelerate_config_that_cpu_processes_cannot_honour_is_refused_in_one_line(name, message, tmp_path,
                                                                                   monkeypatch, capsys):
    from hf_loops.training.train_tah2 import main

    env = launcher_environment(write_accelerate_config(tmp_path, name))
    for key in set(env) - set(os.environ) | {k for k in env if env[k] != os.environ.get(k)}:
        monkeypatch.setenv(key, env[key])
    code = main(["--base", str(tmp_path / "no-such-base"), "--dataset", str(tmp_path / "none.jsonl"),
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert code == 2 and err[-1] == errors[-1] and len(errors) == 1 and message in errors[0], err
    assert not (tmp_path / "out").exists()  # refused before anything was loaded or written


def test_deepspeed_zero3_accelerate_config_is_refused(tmp_path, monkeypatch):
    """ZeRO-3 fails in TaH2's backward (measured on CPU with DeepSpeed 0.19); the refusal needs no DeepSpeed install,
    so it is checked on `check_launch` itself (building the Trainer's arguments would first ask for the package)."""
    from types import SimpleNamespace

    from hf_loops.training.train_tah2 import check_launch

    env = launcher_environment(write_accelerate_config(tmp_path, "zero3"))
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        if key in env:
            monkeypatch.setenv(key, env[key])
    args = SimpleNamespace(deepspeed=None, fsdp_plugin_args=None, use_cpu=True)
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-3 \(from the accelerate config\) cannot train TaH2 yet"):
        check_launch(args)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    check_launch(args)  # ZeRO-2 passes (measured: the same step as one process, see the README)
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="ZeRO-3 \\(from the Trainer's deepspeed config\\)"):
        check_launch(SimpleNamespace(deepspeed=str(ds_file), fsdp_plugin_args=None, use_cpu=True))


@pytest.mark.slow  # a third 2-process launch; runs only where DeepSpeed is installed (it is not a dependency)
def test_deepspeed_zero2_accelerate_config_file_trains_the_same_step(tmp_path, one_process):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed; CPU: DS_ACCELERATOR=cpu)")
    launch(write_accelerate_config(tmp_path, "zero2"), "config", tmp_path, DS_ACCELERATOR="cpu")
    a, b = (torch.load(tmp_path / f"config_rank{r}.pt", weights_only=False) for r in (0, 1))
    for rank in (a, b):
        assert rank["distributed_type"] == "DistributedType.DEEPSPEED" and rank["wrapped"] == "DeepSpeedEngine"
    check_same_step_as_one_process(a, b, one_process)
