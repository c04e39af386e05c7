"""`hf-loops train --arch standard` saves the Qwen3ForCausalLM it trained (issue 36): plain transformers (and a
process without hf_loops) load it with the trained model's logits, the next `hf-loops train --base` takes it, a
standard run resumes from its (TaH2-typed) checkpoint-N, and a LoRA run saves the merged Qwen3 model."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: F401  (the `data` fixture)
from safetensors.torch import load_file

from hf_loops.training import train_tah2
from hf_loops.training.train_tah2 import main as train_main
from hf_loops.training.train_tah2 import train

STEPS = {"max_steps": 2, "logging_steps": 1, "disable_tqdm": True, "save_strategy": "steps", "save_steps": 2}

# Loads a checkpoint with plain transformers in a process where hf_loops cannot be imported, no remote code.
PLAIN_CHILD = textwrap.dedent("""
    import sys
    sys.modules["hf_loops"] = None
    import torch
    from transformers import AutoModelForCausalLM
    path, ids_path, out_path = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and type(model).__module__.startswith("transformers."), type(model)
    with torch.no_grad():
        torch.save(model(torch.load(ids_path)).logits, out_path)
""")


def _ids(vocab=300):
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def standard(data, tmp_path_factory):
    """A 2-step standard run (checkpoint-2 kept) and the trained TaH2 model's logits, taken before anything reloads."""
    out = tmp_path_factory.mktemp("standard") / "run"
    # τ as `_argv` gives it, so the CLI runs below resume this run's checkpoint with the same loop settings
    trainer = train(data["base"], data["train"], out, "standard", tokenizer=data["tokenizer"], recipe="tiny-cpu",
                    model={"exit_threshold": 0.05}, trainer=STEPS)
    model = trainer.model.eval()
    assert type(model).__name__ == "TaH2ForCausalLM" and model.config.max_iterations == 1
    with torch.no_grad():
        logits = model(_ids()).logits
    return {"out": out, "logits": logits, "trainer": trainer}


@pytest.mark.slow
def test_standard_run_saves_the_qwen3_model_it_trained(standard, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    out = standard["out"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"] and "auto_map" not in cfg
    assert not any(k in cfg for k in ("max_iterations", "decider", "updater"))  # no TaH2 field leaks into Qwen3's
    assert not [f for f in os.listdir(out) if f.endswith(".py")]  # no remote code
    assert {"model.safetensors", "generation_config.json", "tokenizer.json", "README.md", "trainer_state.json",
            "train_results.json", "run_config.json"} <= set(os.listdir(out))
    record = json.loads((out / "run_config.json").read_text())
    assert record["script"]["arch"] == "standard" and record["model"]["max_iterations"] == 1
    card = (out / "README.md").read_text()
    assert "class `Qwen3ForCausalLM`" in card and "--arch standard" in card
    assert "TaH2ForCausalLM" not in card and "trust_remote_code" not in card and "looped-transformer" not in card

    plain, info = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    auto = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(auto) is Qwen3ForCausalLM
    with torch.no_grad():
        got = plain.eval()(_ids()).logits
    assert (got - standard["logits"]).abs().max() <= 1e-6

    torch.save(_ids(), tmp_path / "ids.pt")
    script = tmp_path / "child.py"
    script.write_text(PLAIN_CHILD)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "ids.pt"), str(tmp_path / "l.pt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (torch.load(tmp_path / "l.pt") - standard["logits"]).abs().max() <= 1e-6

    # checkpoint-N stays TaH2 (it is for resuming), loadable by remote code as before
    ckpt = json.loads((out / "checkpoint-2" / "config.json").read_text())
    assert ckpt["model_type"] == "tah2" and ckpt["max_iterations"] == 1 and "auto_map" in ckpt
    assert "modeling_tah2.py" in os.listdir(out / "checkpoint-2")


@pytest.mark.slow
def test_tah2_run_from_a_standard_run_starts_from_its_weights(standard, data, tmp_path, monkeypatch):
    """The chain a user tries: post-train Standard, then `hf-loops train --base <it> --arch tah2`."""
    built = {}
    real = train_tah2.build_model

    def recording_build(base, overrides, dtype="float32", seed=None):
        model = real(base, overrides, dtype, seed)
        built["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            built["depth1"] = model.eval()(_ids(), max_iterations=1).logits
        model.train()
        return model

    monkeypatch.setattr(train_tah2, "build_model", recording_build)
    out = tmp_path / "tah2"
    assert train_main(_argv({**data, "base": str(standard["out"])}, out)) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "tah2"
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    saved = load_file(str(standard["out"] / "model.safetensors"))
    state = built["state"]
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())  # every Standard weight, exactly
    assert {k.split(".")[0] for k in set(state) - set(saved)} <= {"updater", "decider", "lm_head"}  # lm_head: tied
    assert (built["depth1"] - standard["logits"]).abs().max() <= 1e-6


@pytest.mark.slow
def test_a_standard_run_resumes_from_its_checkpoint(standard, data, tmp_path):
    import shutil

    run = tmp_path / "resumed"
    shutil.copytree(standard["out"] / "checkpoint-2", run / "checkpoint-2")
    assert train_main(_argv(data, run, "--max_steps", "3", "--resume-from-checkpoint", "true", arch="standard")) == 0
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.slow
def test_a_lora_standard_run_saves_the_merged_qwen3_model(data, tmp_path):
    from transformers import Qwen3ForCausalLM

    from hf_loops.training.tah2_trainer import _unwrap

    out = tmp_path / "lora"
    trainer = train(data["base"], data["train"], out, "standard", tokenizer=data["tokenizer"], recipe="tiny-cpu",
                    lora=True, trainer={"max_steps": 1, "disable_tqdm": True, "learning_rate": 1e-2})
    merged = _unwrap(trainer.model).eval()  # merge_and_unload ran before the save: plain linears again
    assert not any("lora" in k for k in merged.state_dict())
    plain, info = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (plain.eval()(_ids()).logits - merged(_ids()).logits).abs().max() <= 1e-6


@pytest.mark.parametrize("settings", [{"decider": "never", "updater": "identity"}, {},  # the preset; learned modules
                                      {"core_adapter": "huginn", "iteration_attention": "same_iter",
                                       "decider": "always", "mixture": "final", "updater": "identity"},
                                      {"iteration_attention": "same_iter", "updater": "hidden", "decider": "exit_gate",
                                       "mixture": "final"}])
def test_what_the_qwen3_save_drops_never_runs_at_depth_1(settings):
    """The dropped modules (learned updater/decider, Huginn adapter, exit gate) never run in an M = 1 forward or
    generate, and the Qwen3 model of the rest gives the same logits bit for bit."""
    from helpers.tah2_helpers import tiny_qwen3

    from hf_loops.conversion import convert_qwen3
    from hf_loops.conversion.standard import NOT_RUN_AT_DEPTH_1, standard_to_qwen3

    model = convert_qwen3(tiny_qwen3(), "tah2", seed=0, max_iterations=1, **settings).eval()
    ran = []
    for name in NOT_RUN_AT_DEPTH_1:
        if getattr(model, name) is not None:
            getattr(model, name).register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
    qwen, dropped = standard_to_qwen3(model)
    present = {n for n in NOT_RUN_AT_DEPTH_1 if getattr(model, n) is not None}
    assert {k.split(".")[0] for k in dropped} == present
    assert set(qwen.state_dict()) | set(dropped) == set(model.state_dict())
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, qwen(ids).logits)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           qwen.generate(ids, max_new_tokens=4, do_sample=False))
    assert ran == []


def test_a_looped_model_is_not_saved_as_qwen3(capsys):
    from helpers.tah2_helpers import tiny_tah2

    from hf_loops.conversion.standard import standard_to_qwen3

    model = tiny_tah2(max_iterations=2)
    with pytest.raises(ValueError, match="max_iterations == 1"):
        standard_to_qwen3(model)
    assert train_tah2.standard_as_qwen3(model, "standard") == (model, None)  # --arch standard --max-iterations 2
    assert "saved as TaH2" in capsys.readouterr().err
    assert train_tah2.standard_as_qwen3(model, "tah2") == (model, None)
