"""`hf-loops train`: post-train Qwen3(-Base) into TaH2 (or a baseline) with `TaH2SFTTrainer`.

    hf-loops train --base DIR_OR_HUB_ID --arch tah2 --dataset data.jsonl --output-dir out \
        [--eval-dataset FILE_OR_ID [--eval-split test]] [--recipe paper|tiny-cpu|FILE.yaml] [--lora] \
        [any TaH2Config loop field: --max-iterations 2 --exit-threshold 0.5 --iteration_attention same_iter ...] \
        [--push-to-hub REPO [--private]] [--resume-from-checkpoint PATH|true] [--debug] \
        [any SFTConfig field: --learning_rate 1e-4 --max_length none ...]

Precedence: built-in defaults (the --arch preset) < recipe < command line. `none`/`null` set an optional field to None.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
RECIPES = {"paper": "tah2_paper.yaml", "tiny-cpu": "tah2_tiny_cpu.yaml"}
ARCHS = ("tah2", "tah2-fixed", "standard", "ouro")
# Words that set an optional field to None on the command line (`--max_length none`).
NONE_WORDS = ("none", "null")
# Optional trainer fields where "none" is a value of its own (report_to=none: no integrations), not None.
NONE_IS_A_VALUE = ("report_to",)
DEBUG_HINT = "(rerun with --debug for the traceback)"


def model_fields() -> dict[str, str]:
    """{name: annotation} of the fields TaH2Config adds over Qwen3Config (the loop knobs), in declaration order.

    These are the recipe keys and command-line options that configure the model rather than the trainer."""
    import dataclasses

    from transformers import Qwen3Config

    from ..modeling.configuration_tah2 import TaH2Config

    qwen = {f.name for f in dataclasses.fields(Qwen3Config)}
    return {f.name: str(f.type) for f in dataclasses.fields(TaH2Config) if f.name not in qwen}


def field_help(name: str, annotation: str) -> str:
    """The field's line of the TaH2Config docstring (one place for the description), for `--help`."""
    from ..modeling.configuration_tah2 import TaH2Config

    found = re.search(rf"^ +(?:\w+, )*{name}(?:, \w+)* \(`[^`]*`, [^)]*\): (.*?)(?=^ +(?:\w+, )*\w+ \(`|\Z)",
                      TaH2Config.__doc__ or "", re.M | re.S)
    text = f"{annotation}: {' '.join(found.group(1).split())}" if found else annotation
    return text.replace("%", "%%")


def parse_model_value(annotation: str, text: str):
    """A command-line string typed by the field's annotation; a value that does not parse is passed on as the string,
    so TaH2Config's own validation reports it with the field name."""
    word = text.strip().lower()
    if word in NONE_WORDS and "None" in annotation:
        return None
    if "bool" in annotation:
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(word, text)
    for name, kind in (("int", int), ("float", float)):
        if name in annotation:
            try:
                return kind(text)
            except ValueError:
                return text
    return text


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


def assistant_only_dataset(ds, tokenizer, split: bool | None = None):
    """Loss on assistant tokens only. TRL needs `{% generation %}` markers in the chat template (it patches the
    templates it knows); for any other template (or with `split=True`) each conversation ending in an assistant turn
    becomes a prompt/completion pair (loss on that final turn), which works with any template."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if split is False:
        return ds
    if split is None:
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

    if split is None:
        print("note: the chat template has no {% generation %} markers; training on each conversation's final "
              "assistant turn (prompt/completion)", file=sys.stderr)
    return ds.map(split_last_turn, remove_columns=ds.column_names)


def _to_cli_args(fields: dict) -> list[str]:
    args = []
    for key, value in fields.items():
        if value is None:  # `max_length: null` in a recipe means None, as `--max_length none` does
            value = "none"
        elif isinstance(value, (dict, list)) and key != "report_to":
            value = json.dumps(value)
        elif isinstance(value, list):
            value = ",".join(value)
        args += [f"--{key}", str(value)]
    return args


def build_parser(fields: dict[str, str] | None = None) -> argparse.ArgumentParser:
    fields = model_fields() if fields is None else fields
    p = argparse.ArgumentParser(prog="hf-loops train", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="Qwen3(-Base) checkpoint: local directory or Hub id")
    p.add_argument("--arch", default="tah2", choices=ARCHS)
    p.add_argument("--dataset", required=True, help="local .jsonl/.json or Hub dataset id")
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--eval-dataset", default=None, metavar="FILE_OR_ID",
                   help="evaluation data, loaded like --dataset; unless the recipe or command line sets "
                        "eval_strategy, it is evaluated at the end of each epoch (every N steps with --eval_steps N)")
    p.add_argument("--eval-split", default="test", help="split of a Hub (or directory) --eval-dataset (default: test)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or id (default: --base)")
    p.add_argument("--recipe", default=None, help=f"one of {sorted(RECIPES)} or a YAML file")
    p.add_argument("--lora", action="store_true", help="LoRA on the backbone linears; updater/decider fully trained")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--push-to-hub", default=None, metavar="REPO")
    p.add_argument("--private", action="store_true")
    p.add_argument("--resume-from-checkpoint", default=None)
    p.add_argument("--debug", action="store_true", help="on failure, show the full traceback")
    loop = p.add_argument_group("model", "TaH2Config loop fields (default: the --arch preset; `none` for None)")
    for name, annotation in fields.items():
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        loop.add_argument(*flags, dest=name, default=None, metavar="VALUE", help=field_help(name, annotation))
    return p


def model_overrides(arch: str, recipe: dict, args: argparse.Namespace, fields: dict[str, str]) -> dict:
    """TaH2Config overrides: the --arch preset < recipe < command line, validated by TaH2Config itself.

    For `--arch standard` the recipe cannot change the preset's keys: recipes describe TaH2 runs (M = 2), the
    standard baseline is one pass."""
    from ..modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config

    preset = TAH2_PRESETS[arch]
    out = dict(preset)
    for name, annotation in fields.items():
        if name in recipe:
            value = recipe.pop(name)
            if isinstance(value, str):  # YAML reads `5e-1` as a string
                value = parse_model_value(annotation, value)
            if not (arch == "standard" and name in preset):
                out[name] = value
    for name, annotation in fields.items():
        text = getattr(args, name)
        if text is not None:
            out[name] = parse_model_value(annotation, text)
    TaH2Config(**out)  # ValueError naming the field, before any data or weights are loaded
    return out


def build_model(base: str, overrides: dict):
    from ..conversion import convert_qwen3

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


def _given(name: str, cli: list[str], recipe: dict) -> bool:
    """Whether a trainer field is set on the command line (either spelling, `--x v` or `--x=v`) or in the recipe."""
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    return name in recipe or any(a.split("=", 1)[0] in flags for a in cli)


def trainer_config(recipe: dict, rest: list[str], output_dir: str, eval_dataset: bool):
    """The TaH2SFTConfig of defaults < recipe < command line. `none`/`null` set an optional field to None."""
    import typing

    from transformers import HfArgumentParser

    from .tah2_trainer import TaH2SFTConfig

    cli = _to_cli_args(recipe) + list(rest)
    if eval_dataset and not _given("eval_strategy", rest, recipe):
        # An eval set without a schedule: every --eval_steps N steps if given, else at the end of each epoch (which
        # includes the end of a run cut short by max_steps).
        cli += ["--eval_strategy", "steps" if _given("eval_steps", rest, recipe) else "epoch"]
    parser = HfArgumentParser(TaH2SFTConfig)
    hints = typing.get_type_hints(TaH2SFTConfig)
    for action in parser._actions:
        hint = hints.get(action.dest)
        if hint is not None and type(None) in typing.get_args(hint) and action.dest not in NONE_IS_A_VALUE:
            action.type = _none_or(action.type)
    (config,) = parser.parse_args_into_dataclasses(args=cli + ["--output_dir", output_dir])
    return config


def _none_or(convert):
    def parse(text):
        if isinstance(text, str) and text.strip().lower() in NONE_WORDS:
            return None
        return text if convert is None else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its error messages
    return parse


def drop_truncated_examples(trainer, sizes: dict[str, int], max_length: int | None) -> None:
    """Report the examples that truncation left without a completion/assistant token.

    TRL 1.16 tokenises in `SFTTrainer.__init__`, truncates each example to `max_length` there (not in the collator)
    and silently drops the rows whose labels are then all -100, so an over-short `max_length` ends in an empty dataset
    and a cryptic `num_samples=0` at `train()`. `sizes` are the dataset sizes before the trainer prepared them."""
    if max_length is None or trainer.args.packing:
        return  # no truncation (packing chunks sequences instead of cutting completions)
    for split, before in sizes.items():
        ds = trainer.train_dataset if split == "train" else trainer.eval_dataset
        after = len(ds)
        if before == 0:
            raise ValueError(f"the {split} dataset has no examples")
        if after == 0:
            raise ValueError(
                f"truncation at max_length={max_length} removed every completion token from all {before} {split} "
                "examples (the prompt fills the window); use a larger --max_length"
            )
        if after < before:
            print(f"note: dropped {before - after} of {before} {split} examples: truncation at "
                  f"max_length={max_length} left them without a completion token", file=sys.stderr)


def _core_model(model):
    from .tah2_trainer import _unwrap

    return _unwrap(model)


def remote_code_callback():
    """A TrainerCallback that makes every `checkpoint-N` directory loadable with `trust_remote_code=True` where
    hf_loops is not installed: `auto_map` in config.json plus the modeling files, as in the final save."""
    from transformers import PreTrainedModel, TrainerCallback
    from transformers.dynamic_module_utils import custom_object_save

    from ..conversion import remote_code_saving

    class RemoteCodeCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            core = _core_model(model) if model is not None else None
            # A LoRA checkpoint holds adapter weights only (no config.json): nothing to load with remote code.
            if not args.should_save or not isinstance(core, PreTrainedModel) or \
                    not os.path.isfile(os.path.join(folder, "config.json")):
                return
            with remote_code_saving(core):  # the same registration as the final save_pretrained
                custom_object_save(core, folder, config=core.config)  # modeling files + the model auto_map entries
                core.config.save_pretrained(folder)  # configuration file + config.json with auto_map

    return RemoteCodeCheckpoints()


def run(argv: list[str] | None = None):
    """Parse, convert, train, save (and push). Returns the trainer."""
    from transformers import AutoTokenizer

    from ..conversion import remote_code_saving
    from .tah2_trainer import TaH2SFTTrainer

    fields = model_fields()
    args, rest = build_parser(fields).parse_known_args(argv)
    recipe = load_recipe(args.recipe)
    overrides = model_overrides(args.arch, recipe, args, fields)
    config = trainer_config(recipe, rest, args.output_dir, eval_dataset=args.eval_dataset is not None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base)
    except OSError as err:
        raise _offline_hint(f"tokenizer {args.tokenizer or args.base!r}", err) from err
    if "<|im_end|>" in tokenizer.get_vocab():
        tokenizer.eos_token = "<|im_end|>"  # chat SFT ends turns with <|im_end|>, as the released TaH2 checkpoints
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    dataset = load_training_dataset(args.dataset, args.dataset_split)
    eval_dataset = load_training_dataset(args.eval_dataset, args.eval_split) if args.eval_dataset else None
    if not _given("assistant_only_loss", rest, recipe):
        if "messages" in dataset.column_names:
            dataset = assistant_only_dataset(dataset, tokenizer)
            config.assistant_only_loss = "messages" in dataset.column_names
        if eval_dataset is not None and "messages" in eval_dataset.column_names:
            # The eval loss covers the same tokens as the training loss: the assistant turns, or the final one.
            eval_dataset = assistant_only_dataset(eval_dataset, tokenizer, split=not config.assistant_only_loss)
    model = build_model(args.base, overrides)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model.config.vocab_size}")
    sizes = {"train": len(dataset)} | ({"eval": len(eval_dataset)} if eval_dataset is not None else {})
    trainer = TaH2SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(args.lora_r, args.lora_alpha) if args.lora else None,
        callbacks=[remote_code_callback()],
    )
    drop_truncated_examples(trainer, sizes, config.max_length)
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


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip()}" if lines else type(err).__name__


def _close_progress_bars() -> None:
    """Close the bars a failed run left open (the Trainer's, datasets'): closed now, they do not redraw themselves
    below the error message when the trainer is garbage-collected."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> int:
    """`hf-loops train`: exit code 0, 2 for bad input (ValueError), 1 for any other failure. The failure is the last
    line on stderr (on a fresh line, after any progress bar); `--debug` re-raises it with the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        run(argv)
    except ValueError as err:
        if debug:
            raise
        _close_progress_bars()
        print(f"\nerror: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the CLI reports any failure in one line
        if debug:
            raise
        _close_progress_bars()
        print(f"\n{_last_line(err)} {DEBUG_HINT}", file=sys.stderr)
        return 1
    return 0
