"""`hf-loops train`: post-train Qwen3(-Base) into TaH2 (or a baseline) with `TaH2SFTTrainer`.

    hf-loops train --base DIR_OR_HUB_ID --arch tah2 --dataset data.jsonl --output-dir out \
        [--max-iterations 2] [--exit-threshold 0.5] [--recipe paper|tiny-cpu|FILE.yaml] [--lora] \
        [--push-to-hub REPO [--private]] [--resume-from-checkpoint PATH|true] [any SFTConfig field: --learning_rate 1e-4 ...]

Precedence: built-in defaults < recipe < command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
RECIPES = {"paper": "tah2_paper.yaml", "tiny-cpu": "tah2_tiny_cpu.yaml"}
ARCHS = ("tah2", "tah2-fixed", "standard", "ouro")
# Recipe keys that configure the model rather than the trainer.
MODEL_KEYS = ("max_iterations", "exit_threshold", "iteration_attention", "mixture")


def _offline_hint(what: str, err: Exception) -> ValueError:
    return ValueError(
        f"{what} is not a local path and could not be fetched from the Hugging Face Hub "
        f"(offline or unreachable: {type(err).__name__}: {err})"
    )


def load_recipe(name_or_path: str | None) -> dict:
    if not name_or_path:
        return {}
    import yaml

    path = os.path.join(RECIPES_DIR, RECIPES[name_or_path]) if name_or_path in RECIPES else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"--recipe must be one of {sorted(RECIPES)} or a YAML file; {name_or_path!r} is neither")
    with open(path) as f:
        recipe = yaml.safe_load(f) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe {path!r} must be a YAML mapping of field: value")
    return recipe


def load_training_dataset(spec: str, split: str = "train"):
    """A local .jsonl/.json file (or directory) or a Hub dataset id, normalised to `messages` or prompt/completion."""
    from datasets import load_dataset

    if os.path.isfile(spec):
        ds = load_dataset("json", data_files=spec, split="train")
    elif os.path.isdir(spec):
        ds = load_dataset(spec, split=split)
    else:
        try:
            ds = load_dataset(spec, split=split)
        except Exception as err:  # datasets raises several connection/offline error types
            raise _offline_hint(f"dataset {spec!r}", err) from err
    return normalise_columns(ds)


def normalise_columns(ds):
    """`messages`, `prompt`/`completion` and `text` pass through (TRL formats them); GSM8K-style
    `question`/`answer` rows become a conversational prompt (user turn) and completion (assistant turn)."""
    cols = set(ds.column_names)
    if "messages" in cols or {"prompt", "completion"} <= cols or "text" in cols:
        return ds
    if {"question", "answer"} <= cols:
        # Conversational prompt/completion: TRL applies the tokenizer's chat template and trains on the answer only.
        return ds.map(
            lambda r: {"prompt": [{"role": "user", "content": r["question"]}],
                       "completion": [{"role": "assistant", "content": r["answer"]}]},
            remove_columns=sorted(cols),
        )
    raise ValueError(
        f"dataset columns {sorted(cols)} are not supported: expected 'messages', 'prompt'+'completion', 'text' "
        "or 'question'+'answer'"
    )


def assistant_only_dataset(ds, tokenizer):
    """Loss on assistant tokens only. TRL needs `{% generation %}` markers in the chat template (it patches the
    templates it knows); for any other template each conversation ending in an assistant turn becomes a
    prompt/completion pair (loss on that final turn), which works with any template."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = tokenizer.chat_template
    if template and has_generation_markers(template):
        return ds
    try:
        get_training_chat_template(tokenizer)
        return ds
    except ValueError:
        pass

    def split_last_turn(row):
        msgs = row["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            raise ValueError("every conversation must end with an assistant turn for assistant-only loss")
        return {"prompt": msgs[:-1], "completion": msgs[-1:]}

    print("note: the chat template has no {% generation %} markers; training on each conversation's final "
          "assistant turn (prompt/completion)", file=sys.stderr)
    return ds.map(split_last_turn, remove_columns=ds.column_names)


def _to_cli_args(fields: dict) -> list[str]:
    args = []
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, (dict, list)) and key != "report_to":
            value = json.dumps(value)
        elif isinstance(value, list):
            value = ",".join(value)
        args += [f"--{key}", str(value)]
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-loops train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="Qwen3(-Base) checkpoint: local directory or Hub id")
    p.add_argument("--arch", default="tah2", choices=ARCHS)
    p.add_argument("--dataset", required=True, help="local .jsonl/.json or Hub dataset id")
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or id (default: --base)")
    p.add_argument("--max-iterations", type=int, default=None)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--recipe", default=None, help=f"one of {sorted(RECIPES)} or a YAML file")
    p.add_argument("--lora", action="store_true", help="LoRA on the backbone linears; updater/decider fully trained")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--push-to-hub", default=None, metavar="REPO")
    p.add_argument("--private", action="store_true")
    p.add_argument("--resume-from-checkpoint", default=None)
    return p


def build_model(base: str, arch: str, max_iterations: int | None, exit_threshold: float | None, extra: dict):
    from ..conversion import convert_qwen3
    from ..modeling.configuration_tah2 import TAH2_PRESETS

    overrides = dict(TAH2_PRESETS[arch])
    overrides.update({k: v for k, v in extra.items() if v is not None})
    if arch != "standard":
        if max_iterations is not None:
            overrides["max_iterations"] = max_iterations
        if exit_threshold is not None:
            overrides["exit_threshold"] = exit_threshold
    if os.path.isdir(base):
        return convert_qwen3(base, "tah2", **overrides)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(base, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as err:
        raise _offline_hint(f"base model {base!r}", err) from err
    return convert_qwen3(local, "tah2", **overrides)


def lora_config(r: int, alpha: int):
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        # Only the shared backbone's linears: the updater/decider use the same sub-module names (gate/up/down_proj).
        target_modules=r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
        modules_to_save=["updater", "decider"],
        task_type=TaskType.CAUSAL_LM,
    )


def run(argv: list[str] | None = None):
    """Parse, convert, train, save (and push). Returns the trainer."""
    from transformers import AutoTokenizer, HfArgumentParser

    from ..conversion import remote_code_saving
    from .tah2_trainer import TaH2SFTConfig, TaH2SFTTrainer

    args, rest = build_parser().parse_known_args(argv)
    recipe = load_recipe(args.recipe)
    model_fields = {k: recipe.pop(k) for k in MODEL_KEYS if k in recipe}
    max_iterations = args.max_iterations if args.max_iterations is not None else model_fields.pop("max_iterations", None)
    exit_threshold = args.exit_threshold if args.exit_threshold is not None else model_fields.pop("exit_threshold", None)
    (config,) = HfArgumentParser(TaH2SFTConfig).parse_args_into_dataclasses(
        args=_to_cli_args(recipe) + list(rest) + ["--output_dir", args.output_dir]
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base)
    except OSError as err:
        raise _offline_hint(f"tokenizer {args.tokenizer or args.base!r}", err) from err
    if "<|im_end|>" in tokenizer.get_vocab():
        tokenizer.eos_token = "<|im_end|>"  # chat SFT ends turns with <|im_end|>, as the released TaH2 checkpoints
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    dataset = load_training_dataset(args.dataset, args.dataset_split)
    if "messages" in dataset.column_names and "--assistant_only_loss" not in rest and "assistant_only_loss" not in recipe:
        dataset = assistant_only_dataset(dataset, tokenizer)
        config.assistant_only_loss = "messages" in dataset.column_names
    model = build_model(args.base, args.arch, max_iterations, exit_threshold, model_fields)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model.config.vocab_size}")
    trainer = TaH2SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(args.lora_r, args.lora_alpha) if args.lora else None,
    )
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "true" else resume)

    final = trainer.model
    if hasattr(final, "merge_and_unload"):
        final = final.merge_and_unload()
    final.generation_config.eos_token_id = tokenizer.eos_token_id
    final.generation_config.pad_token_id = tokenizer.pad_token_id
    with remote_code_saving(final):
        final.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    if args.push_to_hub:
        push_checkpoint(args.output_dir, args.push_to_hub, private=args.private)
    return trainer


def push_checkpoint(folder: str, repo_id: str, private: bool = False) -> None:
    """Upload the final checkpoint (not the intermediate Trainer checkpoints) in one commit."""
    from ..conversion.hub import push_folder

    try:
        push_folder(folder, repo_id, private=private, commit_message="Upload TaH2 model (hf_loops)",
                    ignore_patterns=["checkpoint-*", "checkpoint-*/**", "runs/**"])
    except Exception as err:  # network/auth/offline errors of huggingface_hub have many types
        raise ValueError(f"could not push {folder!r} to the Hub repo {repo_id!r}: {type(err).__name__}: {err}") from err


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
