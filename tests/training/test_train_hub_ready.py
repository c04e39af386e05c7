"""`hf-loops train` output is a complete Hub repository: the model card `export` writes (YAML metadata, plus the
training facts), `use_cache: true` in config.json, and the same end-of-sequence convention as a converted model;
`--push-to-hub` uploads all of it in one commit (huggingface_hub mocked, no network)."""

import json
import os
from unittest import mock

import pytest
import yaml
from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: F401  (the `data` fixture)

from hf_loops.training.train_tah2 import run as train_run


class FakeApi:
    """Records what would be uploaded; any other Hub call fails the test."""

    calls: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=False, exist_ok=False, repo_type=None, **kw):
        FakeApi.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, repo_id, folder_path, commit_message=None, ignore_patterns=None, **kw):
        files = sorted(os.path.relpath(os.path.join(root, n), folder_path)
                       for root, _, names in os.walk(folder_path) for n in names)
        FakeApi.calls.append(("upload_folder", repo_id, files, ignore_patterns))
        return "commit-info"


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "run"
    FakeApi.calls = []
    with mock.patch("hf_loops.conversion.hub.HfApi", FakeApi):
        trainer = train_run(_argv(data, out, "--eval-dataset", data["eval"], "--push-to-hub", "me/tiny-tah2-sft"))
    return {"out": out, "trainer": trainer, "calls": list(FakeApi.calls)}


def test_trained_model_card_has_the_export_metadata_and_the_training_facts(trained, data):
    out = trained["out"]
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"
    assert {"hf_loops", "tah2", "looped-transformer", "trl", "sft"} <= set(meta["tags"])
    assert "base_model" not in meta  # --base is a local directory, not a Hub id
    assert f"**Source checkpoint:** `{data['base']}`" in card
    assert "# tiny-tah2-sft" in card and 'from_pretrained("me/tiny-tah2-sft", trust_remote_code=True)' in card
    assert "## Training" in card and "TaH2SFTTrainer" in card
    assert f"- dataset: `{data['train']}`" in card and f"- evaluation dataset: `{data['eval']}`" in card
    assert "- recipe: `tiny-cpu`" in card and "- optimizer steps: `2`" in card
    results = json.load(open(out / "train_results.json"))
    assert f"| `train_loss` | {results['train_loss']:.6g} |" in card
    evals = [h for h in trained["trainer"].state.log_history if "eval_loss" in h]
    assert f"| `eval_loss` | {evals[-1]['eval_loss']:.6g} |" in card
    lr = trained["trainer"].args.learning_rate
    assert f"| `learning_rate` | `{lr}` |" in card
    assert "| `max_iterations` | `2` |" in card  # the config summary export writes


def test_trained_config_says_use_cache_true(trained):
    cfg = json.load(open(trained["out"] / "config.json"))
    gen = json.load(open(trained["out"] / "generation_config.json"))
    assert cfg["use_cache"] is True and gen.get("use_cache", True) is True


def _token_fields(folder):
    cfg = json.load(open(folder / "config.json"))
    gen = json.load(open(folder / "generation_config.json"))
    return cfg["eos_token_id"], cfg.get("pad_token_id"), gen["eos_token_id"], gen.get("pad_token_id")


def test_trained_and_converted_models_share_one_eos_convention(trained, data, tmp_path):
    from transformers import AutoTokenizer

    from hf_loops.conversion import convert_qwen3, export

    tok = AutoTokenizer.from_pretrained(data["tokenizer"])
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    base_eos = json.load(open(os.path.join(data["base"], "config.json")))["eos_token_id"]
    trained_ids = _token_fields(trained["out"])
    # config.json: the tokenizer's end token alone; generation_config.json: every stop id, that token first.
    assert trained_ids[0] == im_end and trained_ids[1] == endoftext
    assert trained_ids[2][0] == im_end and set(trained_ids[2]) == {im_end} | ({base_eos} - {None})
    assert trained_ids[3] == endoftext
    export(convert_qwen3(data["base"], "tah2"), tmp_path / "conv", tokenizer=tok)
    assert _token_fields(tmp_path / "conv") == trained_ids  # the converted model follows the same convention


def test_push_to_hub_uploads_the_complete_repository_in_one_commit(trained):
    calls = trained["calls"]
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"] and calls[0][1] == "me/tiny-tah2-sft"
    files, ignored = calls[1][2], calls[1][3]
    assert {"README.md", "config.json", "generation_config.json", "model.safetensors", "modeling_tah2.py",
            "configuration_tah2.py", "loop_utils.py", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert "checkpoint-*" in ignored  # the Trainer's intermediate checkpoints stay local


def test_card_names_a_hub_base_model_and_hub_datasets():
    from helpers.tah2_helpers import tiny_tah2

    from hf_loops.conversion.model_card import render_model_card

    facts = {"trainer": "TaH2SFTTrainer", "dataset": "openai/gsm8k", "dataset_split": "train", "steps": 10,
             "hyperparameters": {"learning_rate": 1e-4}, "metrics": {"train_loss": 1.25}}
    meta = front_matter(render_model_card(tiny_tah2(), source="Qwen/Qwen3-0.6B-Base", training=facts))
    assert meta["base_model"] == "Qwen/Qwen3-0.6B-Base" and meta["base_model_relation"] == "finetune"
    assert meta["datasets"] == ["openai/gsm8k"]
    converted = front_matter(render_model_card(tiny_tah2(), source="Qwen/Qwen3-0.6B-Base"))
    assert converted["base_model"] == "Qwen/Qwen3-0.6B-Base" and "base_model_relation" not in converted
