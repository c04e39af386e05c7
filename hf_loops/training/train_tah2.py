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

from ..core.compat import activation_checkpointing_on
from ..core.errors import DEBUG_HINT  # noqa: F401  (one hint for every command)
from ..core.loading import check_tokenizer_fits
from ..modeling.configuration_tah2 import TAH2_PRESETS

RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
RECIPES = {"paper": "tah2_paper.yaml", "tiny-cpu": "tah2_tiny_cpu.yaml"}
# `--arch` choices: the TaH2 presets (TaH2 and its baselines), read from `TAH2_PRESETS`.
ARCHS = tuple(TAH2_PRESETS)
# Words that set an optional field to None on the command line (`--max_length none`).
NONE_WORDS = ("none", "null")
# Optional trainer fields where "none" is a value of its own (report_to=none: no integrations), not None.
NONE_IS_A_VALUE = ("report_to",)
DTYPES = ("float32", "bfloat16", "auto")
# The trainer fields that choose the device and precision; when none is given, `device_defaults` picks them.
DEVICE_FIELDS = ("use_cpu", "bf16", "fp16", "no_cuda")
# Written into --output-dir with the final model: the resolved arguments of the run.
RUN_CONFIG_FILE = "run_config.json"


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
    if annotation.startswith("list"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
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
    from ..core.readers import read_text

    text = read_text(path, "recipe")
    try:
        recipe = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:  # a syntax error, or a tag safe_load refuses (!!python/object: runs code)
        mark = getattr(err, "problem_mark", None)
        at = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"recipe {at}: not a plain YAML mapping ({' '.join(str(problem).split())})") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe {path!r} must be a YAML mapping of field: value")
    return recipe


def load_training_dataset(spec: str, split: str = "train"):
    """A local .jsonl/.json file (or directory) or a Hub dataset id, normalised to `messages` or prompt/completion.

    Every row is checked first: a malformed JSON line, an empty file, a row without a required field (`answer`, …) or
    with `null` in it → `ValueError` naming the file and line (the row index for directories and Hub datasets)."""
    from datasets import load_dataset

    if os.path.islink(spec) and not os.path.exists(spec):  # a symlink loop or a dangling link: the file's problem
        from ..core.readers import read_text

        read_text(spec, "dataset file")
    if os.path.isfile(spec):
        rows, lines = check_data_file(spec)
        cols = set().union(*(r.keys() for r in rows))
        check_rows(rows, cols, (lambda i: f"{spec}:{lines[i]}") if lines else (lambda i: f"{spec}: item {i + 1}"))
        try:
            ds = load_dataset("json", data_files=spec, split="train")
        except Exception as err:
            raise ValueError(f"dataset file {spec!r} cannot be read as one table ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}); give every row the same fields and types") from None
        return normalise_columns(ds, spec)
    elif os.path.isdir(spec):
        ds = load_dataset(spec, split=split)
        where = lambda i: f"{spec} (split {split!r}): row {i + 1}"  # noqa: E731
    else:
        try:
            ds = load_dataset(spec, split=split)
        except Exception as err:  # datasets raises several connection/offline error types
            raise _offline_hint(f"dataset {spec!r}", err) from err
        where = lambda i: f"dataset {spec!r} (split {split!r}): row {i + 1}"  # noqa: E731
    if len(ds) == 0:
        raise ValueError(f"dataset {spec!r} has no rows")
    required = sorted(_required_fields(set(ds.column_names)))
    check_rows(ds.select_columns(required) if required else [], set(ds.column_names), where)
    return normalise_columns(ds, spec)


def check_data_file(path: str) -> tuple[list[dict], list[int] | None]:
    """Parse a local JSON Lines (or JSON list) file: an empty file, bytes that are not UTF-8, a malformed line or a row
    that is not an object → `ValueError` with the file and line (`core.readers`). Returns the rows and the line number
    of each (None for a JSON list)."""
    from ..core.readers import read_jsonl, read_text

    text = read_text(path, "dataset file")  # a byte that is not UTF-8 is named here (file, line), not inside datasets
    stripped = text.lstrip()
    if stripped and not stripped.startswith("[") and "\n" in text.strip():
        # a pretty-printed JSON object (one row, or columns of lists) rather than JSON Lines
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            columnar = whole and all(isinstance(v, list) for v in whole.values())
            return ([], None) if columnar else ([whole], [text[:len(text) - len(stripped)].count("\n") + 1])
    return read_jsonl(path, "dataset file")


def _required_fields(cols: set[str]) -> dict[str, tuple[type, ...]]:
    """The fields every row needs, by the format the columns announce (the same order as `normalise_columns`)."""
    if "messages" in cols:
        return {"messages": (list,)}
    if {"prompt", "completion"} <= cols:
        return {"prompt": (str, list), "completion": (str, list)}
    if "text" in cols:
        return {"text": (str,)}
    if {"question", "answer"} <= cols:
        return {"question": (str,), "answer": (str,)}
    return {}


def check_rows(rows, cols: set[str], where) -> None:
    """Every row has the format's fields (announced by the union of columns `cols`), with values of the right type:
    not missing, not null. `where(i)` names row i (file and line)."""
    required = _required_fields(cols)
    if not required:
        return  # normalise_columns names the unsupported columns
    names = {str: "a string", list: "a list"}
    for i, row in enumerate(rows):
        for field, types in required.items():
            value = row.get(field)
            if not isinstance(value, types):
                want = " or ".join(names[t] for t in types)
                got = "missing or null" if value is None else f"a {type(value).__name__}"
                raise ValueError(f"{where(i)}: field {field!r} is {got}; expected {want}")
            if field == "messages" and (not value or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value)):
                raise ValueError(f"{where(i)}: field 'messages' must be a non-empty list of "
                                 "{\"role\": ..., \"content\": \"...\"} objects with string content")
            if field == "messages" and not any(m["role"] == "assistant" for m in value):
                raise ValueError(f"{where(i)}: field 'messages' has no assistant turn (the text to train on); roles: "
                                 f"{[m['role'] for m in value]}")


def normalise_columns(ds, name: str | None = None):
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
        f"{f'dataset {name!r}: ' if name else 'dataset '}columns {sorted(cols)} are not supported: expected "
        "'messages', 'prompt'+'completion', 'text' or 'question'+'answer'"
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
    p.add_argument("--resume-from-checkpoint", default=None,
                   help="checkpoint-N directory, or `true` for the latest one in --output-dir")
    p.add_argument("--overwrite-output-dir", action="store_true",
                   help="clear a non-empty --output-dir first (otherwise it is refused, unless resuming)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="dtype of the trained weights. float32 (default): fp32 master weights, with bf16 autocast on "
                        "CUDA; bfloat16: pure-bf16 weights (half the memory, but small updates round away); auto: the "
                        "checkpoint's own dtype")
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
        if text is not None:  # a command-line word, or a value given from Python (`train(model=...)`)
            out[name] = parse_model_value(annotation, text) if isinstance(text, str) else text
    TaH2Config(**out)  # ValueError naming the field, before any data or weights are loaded
    return out


def build_model(base: str, overrides: dict, dtype: str = "float32", seed: int | None = None):
    """The TaH2 model to train: `base` converted, its weights in `dtype` ("auto": the checkpoint's), the new modules
    drawn from `seed`."""
    import torch

    from ..conversion import convert_qwen3

    kw = dict(overrides, seed=seed, dtype=None if dtype == "auto" else getattr(torch, dtype))
    return convert_qwen3(base, "tah2", **kw)  # a Hub id is fetched by the one download path, conversion.hub


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

    cli = _to_cli_args(recipe) + list(rest) + device_defaults(recipe, rest)
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


def _cli_value(name: str, cli: list[str]) -> str | None:
    """The last value given to a trainer field on the command line (`--x v`, `--x=v`, either spelling), or None."""
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    value = None
    for i, word in enumerate(cli):
        flag, eq, text = word.partition("=")
        if flag in flags:
            value = text if eq else (cli[i + 1] if i + 1 < len(cli) else None)
    return value


def save_schedule(recipe: dict, rest: list[str], values: dict) -> list[str]:
    """Checkpoints where the run asks for them: `--save_steps N` (command line, or `trainer=` from Python) while the
    recipe says `save_strategy: "no"` (as `tiny-cpu` does) saves every N steps, said in one line on stderr; the
    Trainer would otherwise save nothing, silently. With `save_strategy no` given beside it, a line says that
    `--save_steps` is ignored. Returns the trainer words to add."""
    if not _given("save_steps", rest, values):
        return []
    steps = values["save_steps"] if "save_steps" in values else _cli_value("save_steps", rest)
    if _given("save_strategy", rest, values):
        strategy = values["save_strategy"] if "save_strategy" in values else _cli_value("save_strategy", rest)
        if str(getattr(strategy, "value", strategy)).strip().lower() == "no":
            print(f"note: --save_steps {steps} is ignored: save_strategy is 'no' (no checkpoints are saved)",
                  file=sys.stderr)
        return []
    if str(recipe.get("save_strategy", "steps")).strip().lower() != "no":
        return []
    print(f"note: saving a checkpoint every {steps} steps as --save_steps asks (the recipe's save_strategy 'no' "
          "becomes 'steps')", file=sys.stderr)
    return ["--save_strategy", "steps"]


def device_defaults(recipe: dict, rest: list[str]) -> list[str]:
    """Trainer arguments for the machine, when neither the recipe nor the command line chooses the device/precision:
    no CUDA → CPU in float32 (said in one line on stderr); CUDA → bf16 autocast (over the fp32 master weights that
    `--dtype float32` loads)."""
    if any(_given(name, rest, recipe) for name in DEVICE_FIELDS):
        return []
    import torch

    if not torch.cuda.is_available():
        print("note: no CUDA device: training on CPU in float32 (use_cpu=True, bf16=False)", file=sys.stderr)
        return ["--use_cpu", "true", "--bf16", "false"]
    return ["--bf16", "true"]


def check_train_output_dir(path: str, overwrite: bool, resume: str | None) -> None:
    """Refuse a non-empty --output-dir unless --overwrite-output-dir or --resume-from-checkpoint is given (changes
    nothing); a file, or a location that cannot be written, is refused too (`core.outdir.check_output_dir`)."""
    from ..core.outdir import check_output_dir

    check_output_dir(path, "--output-dir", overwrite=overwrite or resume is not None,
                     hint="; pass --overwrite-output-dir to clear it, --resume-from-checkpoint to continue its run, "
                          "or choose a new directory")


def clear_output_dir(path: str) -> None:
    """Empty `path` (the directory itself stays: it may be `.` or a mount point; its lock stays too)."""
    from ..core.outdir import clear_dir

    clear_dir(path)
    print(f"note: cleared --output-dir {path!r} (--overwrite-output-dir)", file=sys.stderr)


def check_resume_matches(checkpoint: str, overrides: dict) -> None:
    """A checkpoint resumed with other loop settings (a `--arch standard` run resumed as tah2) has other modules and
    optimizer groups; say which settings differ instead of the optimizer's "parameter group doesn't match"."""
    from ..core.readers import read_json

    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return  # a LoRA checkpoint holds adapters only; the Trainer reports what it cannot load
    saved = read_json(path, "checkpoint config", expect=dict)
    normal = {k: json.loads(json.dumps(v, default=str)) for k, v in overrides.items()}  # tuples → lists, as saved
    differ = {k: (saved[k], v) for k, v in normal.items() if k in saved and saved[k] != v}
    if differ:
        shown = ", ".join(f"{k}={a!r} in the checkpoint, {b!r} in this run" for k, (a, b) in sorted(differ.items()))
        raise ValueError(f"--resume-from-checkpoint {checkpoint!r} was trained with other loop settings ({shown}); "
                         "resume with the same --arch and settings, or start a new --output-dir")


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

    from ..conversion.export import _auto_map_entry, remote_code_saving

    class RemoteCodeCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            core = _core_model(model) if model is not None else None
            # A LoRA checkpoint holds adapter weights only (no config.json): nothing to load with remote code.
            if not args.should_save or not isinstance(core, PreTrainedModel) or \
                    not os.path.isfile(os.path.join(folder, "config.json")):
                return
            plain = plain_model_class(core)  # TaH2ForCausalLM, also under FSDP2 (FSDPTaH2ForCausalLM)
            with remote_code_saving(core, model_cls=plain):  # the same registration as the final save_pretrained
                custom_object_save(plain, folder)  # the modeling files: the class's module and its relative imports
                core.config.auto_map["AutoModelForCausalLM"] = _auto_map_entry(plain)
                core.config.save_pretrained(folder)  # configuration file + config.json with auto_map

    return RemoteCodeCheckpoints()


def run(argv: list[str] | None = None):
    """Parse, convert, train, save (and push). Returns the trainer.

    --output-dir holds one run: a non-empty one is refused unless --overwrite-output-dir (cleared first) or
    --resume-from-checkpoint; the final model, trainer_state.json, train_results.json and run_config.json (the resolved
    arguments) are written to a temporary directory and moved in with config.json last, so the directory never shows
    a new config.json beside old weights."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fields = model_fields()
    args, rest = build_parser(fields).parse_known_args(argv)
    return _train(args, rest, argv, fields)


def train(base: str, dataset: str, output_dir: str, arch: str = "tah2", *, model: dict | None = None,
          trainer: dict | None = None, **options):
    """Post-train `base` on `dataset` into `output_dir` from Python; returns the trainer (as `hf-loops train` does).

    model: TaH2Config loop fields (`{"max_iterations": 3, "exit_threshold": 0.5}`), over the `arch` preset and the
        recipe. trainer: TaH2SFTConfig / TrainingArguments fields (`{"max_steps": 30, "learning_rate": 1e-3}`), over
        the recipe. options: the command's own options by their Python names (`tokenizer`, `recipe`, `eval_dataset`,
        `dtype`, `lora`, `resume_from_checkpoint`, `overwrite_output_dir`, `push_to_hub`, ...).
    Every value is checked as on the command line: an unknown name is a `ValueError` naming the closest valid one."""
    import difflib

    fields = model_fields()
    parser = build_parser(fields)
    args = parser.parse_args(["--base", os.fspath(base), "--dataset", os.fspath(dataset), "--output-dir",
                              os.fspath(output_dir), "--arch", arch])
    script = {a.dest for a in parser._actions} - set(fields) - {"help"}
    for kind, values, allowed in (("option", options, script), ("model field", model or {}, set(fields))):
        for name, value in values.items():
            if name not in allowed:
                close = difflib.get_close_matches(name, sorted(allowed), n=1)
                raise ValueError(f"train: unknown {kind} {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
            setattr(args, name, os.fspath(value) if isinstance(value, os.PathLike) else value)
    if args.resume_from_checkpoint is True:
        args.resume_from_checkpoint = "true"
    argv = ["--base", args.base, "--dataset", args.dataset, "--output-dir", args.output_dir, "--arch", arch]
    from ..core.outdir import run_output_lock

    with run_output_lock(args.output_dir, "output_dir"):  # a second run into the same directory is refused
        return _train(args, [], argv, fields, dict(trainer or {}))


def _train(args, rest: list[str], argv: list[str], fields: dict, trainer_fields: dict | None = None):
    """The run behind `run` (command line) and `train` (Python): `args` holds the script's options and the model's
    loop fields, `rest` the trainer fields as command-line words, `trainer_fields` the trainer fields as values."""
    from transformers import set_seed

    from ..conversion.checks import load_tokenizer
    from ..conversion.export import atomic_output_dir, save_hub_files
    from .tah2_trainer import TaH2SFTTrainer
    from .token_budget import apply_token_budget, pop_token_budget

    check_train_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    recipe_file = load_recipe(args.recipe)
    recipe = {**recipe_file, **(trainer_fields or {})}  # Python values over the recipe file's
    recipe_given = dict(recipe)
    budget = pop_token_budget(recipe, rest)  # max_tokens_per_batch, global_batch_size: batching, not trainer fields
    overrides = model_overrides(args.arch, recipe, args, fields)
    config = trainer_config(recipe, rest + save_schedule(recipe_file, rest, trainer_fields or {}), args.output_dir,
                            eval_dataset=args.eval_dataset is not None)
    check_launch(config)  # before any loading: a launch this machine would run as something else is refused
    if budget is not None:
        budget.detach_max_length(config)  # over-long samples are dropped by the budget sampler, not truncated
    tokenizer = load_tokenizer(args.tokenizer or args.base, "--tokenizer" if args.tokenizer else "--base")
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
    # `seed` covers everything drawn before the Trainer seeds itself: the new modules' initialisation above all.
    set_seed(config.seed)
    model = build_model(args.base, overrides, args.dtype, seed=config.seed)
    check_tokenizer_fits(tokenizer, model.config.vocab_size)
    if args.overwrite_output_dir and os.path.isdir(args.output_dir) and args.resume_from_checkpoint is None:
        # Only now: bad input above leaves the directory as it was. Once per run: the main process clears it while
        # the other ranks wait (they write nothing before their first checkpoint, after this barrier).
        with config.main_process_first(local=False, desc="--overwrite-output-dir"):
            if config.process_index == 0:
                clear_output_dir(args.output_dir)
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
    fsdp_on_cpu(trainer)
    apply_token_budget(trainer, budget)  # the budget sampler and derived accumulation; prints the derivation
    drop_truncated_examples(trainer, sizes, config.max_length)
    resume = args.resume_from_checkpoint
    if resume == "true":  # the newest COMPLETE checkpoint (the Trainer's own choice is the newest folder)
        from .checkpoints import last_complete_checkpoint

        resume = last_complete_checkpoint(args.output_dir)
    if resume:
        check_resume_matches(resume, overrides)
    result = trainer.train(resume_from_checkpoint=resume)

    state_dict = final_state_dict(trainer)  # a collective under FSDP: every rank takes part
    final = trainer.model if state_dict is None else unsharded_model(trainer, state_dict)
    if hasattr(final, "merge_and_unload"):
        final = final.merge_and_unload()
    if trainer.args.should_save:
        trained_config = final.config  # the run record's loop fields: the trained TaH2 model's
        final, card = standard_as_qwen3(final, args.arch)
        with atomic_output_dir(args.output_dir, "train", merge=True) as tmp:
            # The files `export` writes (one eos convention, use_cache on, the model card), plus the run record.
            save_hub_files(final, tmp, tokenizer, source=args.base, repo_id=args.push_to_hub, report=card,
                           title=None if args.push_to_hub else os.path.basename(os.path.abspath(args.output_dir)),
                           training=training_facts(trainer, result, args))
            write_run_record(tmp, trainer, result, args, recipe_given, trained_config, argv, fields)
    if args.push_to_hub and trainer.args.should_save:
        push_checkpoint(args.output_dir, args.push_to_hub, private=args.private)
    return trainer


def standard_as_qwen3(model, arch: str):
    """(the model to save, the model card's parity report or None). A `--arch standard` run (M = 1) is saved as the
    `Qwen3ForCausalLM` it computes (`conversion.standard`): the same tensors under the same names, model_type "qwen3",
    so `--base`, vLLM's native Qwen3 and GGUF converters read it. The modules that never run at M = 1 (updater,
    decider, core adapter; the preset has none) are dropped, with a note naming them. A standard run given
    `--max-iterations` > 1 on the command line is a looped model: it stays TaH2, with a note. Other archs: as is."""
    from ..conversion.standard import NOT_RUN_AT_DEPTH_1, is_one_pass, standard_to_qwen3

    if arch != "standard":
        return model, None
    if not is_one_pass(model):
        print(f"note: --arch standard with max_iterations={model.config.max_iterations} is a looped model: saved as "
              "TaH2 (model_type 'tah2'), not as Qwen3", file=sys.stderr)
        return model, None
    qwen, dropped = standard_to_qwen3(model)
    modules = sorted({k.split(".", 1)[0] for k in dropped})
    if dropped:
        print(f"note: saved as Qwen3ForCausalLM without {', '.join(modules)} ({len(dropped)} tensors): they never run "
              "at max_iterations=1", file=sys.stderr)
    note = ("Saved from the trained TaH2 Standard model (max_iterations = 1) as the Qwen3 model it computes: the same "
            "tensors under the same names, so the logits are that model's exactly"
            + (f"; left out: {', '.join(f'`{m}`' for m in modules)}, which never run at M = 1." if dropped else
               f" (it has no {' / '.join(NOT_RUN_AT_DEPTH_1)})."))
    return qwen, {"parity_note": note}


def final_state_dict(trainer):
    """The full (unsharded) state dict of an FSDP run, gathered from every rank (a collective: all ranks call it; rank 0
    gets the tensors); None otherwise (save the model as is). Under FSDP2 the parameters are DTensor shards:
    `save_pretrained` alone would write one rank's shards."""
    from torch.distributed.fsdp import FSDPModule

    model = trainer.model_wrapped
    if any(isinstance(m, FSDPModule) for m in model.modules()):  # FSDP2 (fully_shard)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(trainer, "is_fsdp_enabled", False):  # FSDP1
        return trainer.accelerator.get_state_dict(model)
    return None


def unsharded_model(trainer, state_dict):
    """A plain (not FSDP-wrapped) model of the trained class holding `state_dict`, to save: FSDP2 swaps the model's
    class for a generated `FSDP<Class>` whose module lives in torch, so saving the wrapped model would copy torch's
    FSDP files as remote code and write `auto_map` entries pointing at them."""
    import torch

    core = _core_model(trainer.model)
    cls = plain_model_class(core)
    if not trainer.args.should_save:
        return core  # only the saving rank builds the copy (the other ranks hold an empty state dict)
    with torch.device("meta"):
        plain = cls(core.config)
    plain.load_state_dict(state_dict, strict=False, assign=True)
    if getattr(core.config, "tie_word_embeddings", False):
        plain.tie_weights()
    own = dict(core.named_buffers())
    for name, buf in list(plain.named_buffers()):  # non-persistent buffers (RoPE frequencies): FSDP2 leaves them whole
        if buf.is_meta and name in own:
            module, _, attr = name.rpartition(".")
            plain.get_submodule(module)._buffers[attr] = own[name].detach().to("cpu").clone()
    missing = [n for n, t in list(plain.named_parameters()) + list(plain.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"the gathered FSDP state dict lacks {missing[:5]}")
    plain.generation_config = core.generation_config
    return plain.eval()


def plain_model_class(model) -> type:
    """The model's own `PreTrainedModel` class: FSDP2's `fully_shard` swaps an instance's class for a generated
    `FSDP<Class>` whose module lives in torch (saving by that class would copy torch's FSDP files as remote code)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    return next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule))


def fsdp_on_cpu(trainer) -> bool:
    """Run FSDP on CPU processes (gloo) too, whether it was asked for by the Trainer's `fsdp`/`fsdp_config` or by
    `accelerate launch --config_file` (`distributed_type: FSDP` puts `ACCELERATE_USE_FSDP=true`, `FSDP_VERSION` and
    the other `FSDP_*` settings in the environment). accelerate 1.15 builds the plugin in both cases but switches FSDP
    on only for accelerator distributed types: on CPU the run would silently be DDP with nothing sharded. Marking the
    state FSDP with that plugin makes `accelerator.prepare` apply `fully_shard` (FSDP2) as on GPUs. The Trainer's own
    settings win over the environment, as they do on GPUs. Returns whether it changed anything."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    plugin_args = trainer.args.fsdp_plugin_args
    if state.distributed_type != DistributedType.MULTI_CPU or (plugin_args is None and not fsdp_from_environment()):
        return False
    check_launch(trainer.args)
    # With no arguments the plugin reads FSDP_VERSION and the other FSDP_* variables itself, as accelerate does.
    plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args is not None else FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)  # what accelerate does for FSDP on accelerators
    if plugin.activation_checkpointing and activation_checkpointing_on(trainer.args):
        # The Trainer's own check on accelerators, which the CPU path skips.
        raise ValueError("FSDP activation checkpointing (fsdp_activation_checkpointing: true) and the "
                         "activation_checkpointing (gradient_checkpointing) training argument cannot both be on; "
                         "use one of them")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # As accelerate's own AcceleratorState does: every later `AcceleratorState()` (the Trainer's checkpoint save, TRL's
    # callbacks) copies PartialState's shared fields over its own, which would turn the run back into MULTI_CPU
    # halfway (a checkpoint save then gathers the DTensor shards on rank 0 alone: a collective mismatch).
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    return True


def fsdp_from_environment() -> bool:
    """Whether the launcher asked for FSDP (`accelerate launch` with `distributed_type: FSDP`, or `--use_fsdp`)."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_FSDP", default=False)


def check_launch(args) -> None:
    """Refuse, in one line and before anything is loaded, a launch that cannot train TaH2 (DeepSpeed ZeRO-3) or that
    this machine would silently run as something else: FSDP1 or parameter offloading on CPU processes (accelerate's FSDP1 plugin needs an accelerator device and fails deep inside the
    Trainer), and an accelerate config with `distributed_type: MULTI_CPU` and several processes, which `accelerate
    launch` starts as ONE plain process unless mpirun runs it. The Trainer's `fsdp_config` wins over the launcher's
    environment, as in the Trainer itself."""
    from accelerate.utils import get_int_from_env, parse_flag_from_env

    world = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    # accelerate's simple (CPU) launcher alone sets ACCELERATE_USE_CPU, and sets MASTER_ADDR only for num_processes > 1
    if parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and world == 1:
        raise ValueError("the accelerate config asks for several CPU processes (distributed_type: MULTI_CPU) but "
                         "accelerate launch started one (it runs MULTI_CPU only through mpirun: mpirun_hostfile); use "
                         "distributed_type: MULTI_GPU with use_cpu: false, which starts gloo processes on CPU, or torchrun")
    stage, source = deepspeed_zero_stage(args)
    if stage == 3:
        # Measured on CPU (DeepSpeed 0.19, ZeRO-3): backward fails. TaH2's zero-weighted anchor over the updater and
        # decider parameters reads them outside their modules, where ZeRO-3 holds empty placeholders.
        raise ValueError(f"DeepSpeed ZeRO-3 (from {source}) cannot train TaH2 yet: the zero-weighted term that reaches "
                         "the updater and decider parameters reads them outside their modules, where ZeRO-3 keeps "
                         "empty placeholders, and backward fails; use ZeRO-2 or FSDP2")
    if args.fsdp_plugin_args is not None:
        version, source = int(args.fsdp_plugin_args.get("fsdp_version", 1)), "the Trainer's fsdp_config"
        offload = bool(args.fsdp_plugin_args.get("cpu_offload", False))
    elif fsdp_from_environment():
        version, source = int(os.environ.get("FSDP_VERSION", "1")), "the accelerate config"
        offload = parse_flag_from_env("FSDP_OFFLOAD_PARAMS", default=False)
    else:
        return
    if not on_cpu(args):
        return
    if version != 2:
        raise ValueError(f"fsdp_version {version} from {source} cannot run on CPU processes (accelerate's FSDP1 "
                         "needs an accelerator device); set fsdp_version: 2 (fully_shard), which runs on CPU with gloo")
    if offload:  # torch's CPUOffloadPolicy pins memory for an accelerator: fully_shard fails without one
        raise ValueError(f"fsdp_offload_params (cpu_offload) from {source} cannot run on CPU processes: the "
                         "parameters already live on the CPU; set it to false")


def deepspeed_zero_stage(args) -> tuple[int | None, str]:
    """The ZeRO stage asked for by the Trainer's `deepspeed` config (a dict or JSON file) or by `accelerate launch`
    with `distributed_type: DEEPSPEED` (a stage, or a DeepSpeed JSON file, in the environment); None without
    DeepSpeed. Returns (stage, where it came from)."""
    from accelerate.utils import parse_flag_from_env

    def stage_of(config) -> int | None:
        if isinstance(config, str) and os.path.isfile(config):
            with open(config) as f:
                config = json.load(f)
        stage = config.get("zero_optimization", {}).get("stage") if isinstance(config, dict) else None
        return None if stage in (None, "auto") else int(stage)

    if getattr(args, "deepspeed", None):
        return stage_of(args.deepspeed), "the Trainer's deepspeed config"
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED", default=False):
        file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if file and file != "none":
            return stage_of(file), "the accelerate config's DeepSpeed file"
        return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")), "the accelerate config"
    return None, ""


def on_cpu(args) -> bool:
    """Whether the Trainer's processes run on CPU (asked for, or no accelerator on this machine)."""
    import torch

    return bool(args.use_cpu) or not torch.accelerator.is_available()


def training_facts(trainer, result, args) -> dict:
    """What the model card says about the run: data, recipe, steps, the hyper-parameters that define it, final
    metrics (the training result, then the last evaluation)."""
    t = trainer.args
    hyper = {"learning_rate": t.learning_rate, "lr_scheduler_type": str(getattr(t.lr_scheduler_type, "value",
                                                                                 t.lr_scheduler_type)),
             "warmup": t.warmup_steps, "weight_decay": t.weight_decay,
             "per_device_train_batch_size": t.per_device_train_batch_size,
             "gradient_accumulation_steps": t.gradient_accumulation_steps, "processes": t.world_size,
             "max_length": getattr(t, "max_length", None), "num_train_epochs": t.num_train_epochs,
             "max_steps": t.max_steps, "seed": t.seed, "weights_dtype": args.dtype, "bf16": t.bf16}
    if args.lora:
        hyper.update(lora_r=args.lora_r, lora_alpha=args.lora_alpha)
    metrics = {k: v for k, v in dict(result.metrics).items() if isinstance(v, (int, float))}
    evals = [h for h in trainer.state.log_history if any(k.startswith("eval_") for k in h)]
    if evals:
        metrics.update({k: v for k, v in evals[-1].items() if k.startswith("eval_") and isinstance(v, (int, float))})
    return {"trainer": type(trainer).__name__, "arch": args.arch, "dataset": args.dataset, "dataset_split": args.dataset_split,
            "eval_dataset": args.eval_dataset, "eval_split": args.eval_split if args.eval_dataset else None,
            "recipe": args.recipe, "steps": trainer.state.global_step,
            "epochs": round(float(trainer.state.epoch or 0), 4), "hyperparameters": hyper, "metrics": metrics}


def write_run_record(folder: str, trainer, result, args, recipe: dict, config, argv: list[str],
                     fields: dict) -> None:
    """What the transformers example scripts leave in a run directory, even without checkpoints: trainer_state.json
    (the log history), train_results.json (the final metrics) and run_config.json — every argument after recipe and
    command-line precedence: the script's options, the model's TaH2Config loop fields, the full trainer config."""
    trainer.state.save_to_json(os.path.join(folder, "trainer_state.json"))
    with open(os.path.join(folder, "train_results.json"), "w") as f:
        json.dump(dict(result.metrics), f, indent=2, sort_keys=True)
    record = {
        "command": ["hf-loops", "train", *argv],
        "script": {k: v for k, v in vars(args).items() if k not in fields},
        "recipe": recipe,
        "model": {name: getattr(config, name, None) for name in fields},  # the model's resolved loop fields
        "trainer": json.loads(trainer.args.to_json_string()),
    }
    with open(os.path.join(folder, RUN_CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True, default=str)


def push_checkpoint(folder: str, repo_id: str, private: bool = False) -> None:
    """Upload the final checkpoint (not the intermediate Trainer checkpoints) in one commit."""
    from ..conversion.hub import push_folder

    try:
        push_folder(folder, repo_id, private=private, commit_message="Upload model (hf-loops train)",
                    ignore_patterns=["checkpoint-*", "checkpoint-*/**", "runs/**"])
    except Exception as err:  # network/auth/offline errors of huggingface_hub have many types
        raise ValueError(f"could not push {folder!r} to the Hub repo {repo_id!r}: {type(err).__name__}: {err}") from err


def _run_locked(argv: list[str]) -> None:
    """`run` with --output-dir locked for the run: a second run into the same directory is refused at once (one
    line), instead of interleaving its checkpoints with this run's. Under `accelerate launch`/`torchrun` the lock is the
    run's, not each process's: rank 0 holds it and the other ranks wait for it (`core.outdir.run_output_lock`)."""
    from ..core.outdir import run_output_lock

    args, _ = build_parser(model_fields()).parse_known_args(argv)
    check_train_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    with run_output_lock(args.output_dir, "--output-dir"):
        run(argv)


def main(argv: list[str] | None = None) -> int:
    """`hf-loops train`: exit code 0, 2 for bad input (ValueError, OSError, a bad recipe), 1 for any other failure.
    The failure is the last line on stderr (on a fresh line, after any progress bar); `--debug` re-raises it with the
    traceback (`core.errors.run_command`)."""
    from ..core.errors import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(_run_locked, argv, debug="--debug" in argv)
