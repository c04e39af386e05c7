"""End-to-end TaH2 post-training: the `hf-loops train` script, multi-process label pooling, resume, LoRA."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hf_loops.training.tah2_labels import compute_depth_labels
from hf_loops.training.train_tah2 import main as train_main
from hf_loops.training.train_tah2 import run as train_run

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers and helpers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    shared = os.path.join(os.path.dirname(HERE), "..", "shared", "data")
    tok_dir = os.path.join(shared, "qwen3-tokenizer")
    gsm = os.path.join(shared, "gsm8k", "gsm8k_test_100.jsonl")
    if not (os.path.isdir(tok_dir) and os.path.isfile(gsm)):
        pytest.skip("../shared/data is not present")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    base = tmp_path_factory.mktemp("base") / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=True)).save_pretrained(base)
    return {"base": str(base), "tokenizer": tok_dir, "gsm": gsm}


def _argv(data, out, arch, *extra):
    return ["--base", data["base"], "--tokenizer", data["tokenizer"], "--arch", arch, "--dataset", data["gsm"],
            "--output-dir", str(out), "--recipe", "tiny-cpu", "--max_length", "64", "--per_device_train_batch_size", "1",
            *extra]


@pytest.mark.parametrize("arch", ["tah2", "tah2-fixed", "standard"])
@pytest.mark.slow
def test_train_script_30_steps_loss_falls_and_checkpoint_generates(data, tmp_path, arch):
    trainer = train_run(_argv(data, tmp_path / "out", arch, "--logging_steps", "10"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 30 and len(logs) == 3
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.3, logs
    if arch == "tah2":
        for key in ("ntp_loss", "decider_loss", "mean_depth", "continue_rate@1", "delta_cut@1", "beta@1",
                    "decider_acc@1", "label_continue_rate@1"):
            assert key in logs[0], key
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    # a Standard run (M = 1) is saved as the Qwen3 model it computes (tests/training/test_train_standard.py)
    assert type(model).__name__ == ("Qwen3ForCausalLM" if arch == "standard" else "TaH2ForCausalLM")
    assert getattr(model.config, "max_iterations", 1) == (1 if arch == "standard" else 2)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("Natalia sold clips to 48 of her friends.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or tok.eos_token_id in out[0, ids.shape[1]:].tolist()
    code = set() if arch == "standard" else {"modeling_tah2.py"}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            *code} <= set(os.listdir(tmp_path / "out"))


@pytest.mark.slow
def test_resume_from_checkpoint_continues_the_run(data, tmp_path):
    extra = ("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1")
    full = train_run(_argv(data, tmp_path / "full", "tah2", *extra))
    partial = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", partial / "checkpoint-2")
    resumed = train_run(_argv(data, partial, "tah2", *extra, "--resume-from-checkpoint", str(partial / "checkpoint-2")))
    def losses(t):
        return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}
    a, b = losses(full), losses(resumed)
    assert resumed.state.global_step == 4 and {3, 4} <= set(b)  # steps 1–2 come from the checkpoint's state
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6)


def test_lora_targets_backbone_linears_and_trains_updater_and_decider_fully():
    from helpers.tah2_helpers import tiny_tah2
    from peft import get_peft_model

    from hf_loops.training.train_tah2 import lora_config

    peft_model = get_peft_model(tiny_tah2(max_iterations=2), lora_config(4, 8))
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("layers.0.self_attn.q_proj.lora_A" in n for n in names)
    assert any("layers.1.mlp.down_proj.lora_B" in n for n in names)
    assert not any("lora_" in n and ("updater" in n or "decider" in n) for n in names)
    full = [n for n in names if "modules_to_save" in n]
    assert any("updater.modules_to_save.default.projection" in n for n in full)
    assert any("decider.modules_to_save.default.score" in n for n in full)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)


@pytest.mark.slow
def test_lora_run_saves_a_merged_checkpoint(data, tmp_path):
    train_run(_argv(data, tmp_path / "lora", "tah2", "--lora", "--lora-r", "4", "--max_steps", "2",
                    "--logging_steps", "1"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    assert type(model).__name__ == "TaH2ForCausalLM"
    assert not any("lora" in n or "modules_to_save" in n for n, _ in model.named_parameters())


@pytest.mark.slow
def test_train_script_errors(data, tmp_path, capsys):
    assert train_main(_argv(data, tmp_path / "x", "tah2")[:-4] + ["--recipe", "nope"]) == 2
    assert "recipe" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    argv = _argv(data, tmp_path / "y", "tah2")
    argv[argv.index("--dataset") + 1] = str(bad)
    assert train_main(argv) == 2
    assert "columns" in capsys.readouterr().err
    argv = _argv(data, tmp_path / "z", "tah2")
    argv[argv.index("--base") + 1] = "nobody/not-a-local-model"
    assert train_main(argv) == 2
    assert "offline" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_pool_cutoffs_and_class_balance_like_one_process(tmp_path):
    out = tmp_path / "dist.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(HERE, "helpers", "dist_labels_worker.py"), str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    dist = torch.load(out)
    assert dist["world"] == 2
    sys.path.insert(0, HERE)
    from helpers.dist_labels_worker import fixed_batch

    executed, losses, look, supervised, M = fixed_batch()
    one = compute_depth_labels(executed, losses, look, supervised, M, coverage=0.9)
    assert dist["delta_cut"] == pytest.approx(one.delta_cut, abs=0)
    assert dist["beta"] == pytest.approx(one.beta, abs=0)
    assert torch.equal(dist["labels"], torch.stack([c.long() for c in one.continue_labels]))


def test_messages_without_generation_markers_train_on_the_final_assistant_turn(data):
    from datasets import Dataset

    from hf_loops.training.train_tah2 import assistant_only_dataset

    tok = AutoTokenizer.from_pretrained(data["tokenizer"])
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}])
    out = assistant_only_dataset(ds, tok)
    assert out.column_names == ["prompt", "completion"]
    assert out[0]["completion"] == [{"role": "assistant", "content": "4"}]
    bad = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="assistant turn"):
        assistant_only_dataset(bad, tok)


@pytest.mark.slow
def test_packed_padding_free_training_runs_and_logs_depth(data, tmp_path):
    trainer = train_run(_argv(data, tmp_path / "packed", "tah2", "--packing", "true", "--max_steps", "2",
                              "--logging_steps", "1", "--per_device_train_batch_size", "2"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert "mean_depth" in logs[0] and "delta_cut@1" in logs[0]


def test_push_uploads_the_final_checkpoint_in_one_commit(tmp_path, monkeypatch):
    import hf_loops.conversion.hub as hub
    from hf_loops.training.train_tah2 import push_checkpoint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoint-2").mkdir()
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False, repo_type=None):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns=None, **kw):
            calls.append(("upload_folder", repo_id, folder_path, tuple(ignore_patterns or ())))

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    push_checkpoint(str(tmp_path), "me/tah2-tiny", private=True)
    assert calls[0] == ("create_repo", "me/tah2-tiny", True, True)
    assert calls[1][0] == "upload_folder" and len(calls) == 2
    assert "checkpoint-*" in calls[1][3]

    class OfflineApi(FakeApi):
        def create_repo(self, *a, **k):
            raise ConnectionError("offline")

    monkeypatch.setattr(hub, "HfApi", OfflineApi)
    with pytest.raises(ValueError, match="could not push"):
        push_checkpoint(str(tmp_path), "me/tah2-tiny")
