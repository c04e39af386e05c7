"""Input checks shared by `convert`, `train` and `generate`: each turns a bad file into one `ValueError` that names the
file (and line or field) and says what was expected, before the expensive work starts."""

from __future__ import annotations

import os

from ..core.readers import read_json


def read_json_file(path: str | os.PathLike, what: str = "") -> dict:
    """A JSON object from `path`; a missing file, bytes that are not UTF-8, invalid JSON or a non-object →
    `ValueError` naming the file and line (`hf_loops.core.readers`)."""
    return read_json(path, what, expect=dict)


def check_config_json(folder: str) -> dict:
    """The checkpoint's `config.json`, with a `model_type`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is not a checkpoint directory: config.json is missing")
    cfg = read_json_file(path)
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"{path!r}: field 'model_type' is missing (expected e.g. \"qwen3\")")
    return cfg


def check_safetensors_files(folder: str) -> None:
    """Open the header of every `.safetensors` file in `folder`: a truncated or garbage file → `ValueError` naming it
    (safetensors checks that the header parses and that every tensor's byte range lies inside the file)."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except Exception as err:
            detail = " ".join(str(err).split())[:200]
            raise ValueError(f"{path!r} is not a valid .safetensors file (truncated or corrupt: {detail}); "
                             "download or save it again") from None


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", "") \
        or os.path.exists(name)


def load_tokenizer(name_or_path: str, flag: str = "--tokenizer"):
    """`AutoTokenizer.from_pretrained` with one-line errors: a path that is not a tokenizer directory, or a Hub id that
    cannot be fetched (offline) → `ValueError` naming `flag` and the value."""
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        if not any(os.path.isfile(os.path.join(name, f)) for f in
                   ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
            hint = "; give --tokenizer DIR" if flag != "--tokenizer" else ""
            raise ValueError(f"{flag} {name!r} holds no tokenizer files (expected tokenizer.json or "
                             f"tokenizer_config.json){hint}")
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as err:
            detail = " ".join(str(err).split())[:200]
            raise ValueError(f"{flag} {name!r}: the tokenizer files cannot be loaded ({type(err).__name__}: "
                             f"{detail})") from None
    if _looks_local(name):
        what = "a file" if os.path.isfile(name) else "not an existing directory"
        raise ValueError(f"{flag} {name!r} is {what}; expected a tokenizer directory or a Hub repository id")
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as err:
        raise ValueError(f"{flag} {name!r} is not a local directory and could not be fetched from the Hugging Face "
                         f"Hub (offline or unreachable, or no such repository: {type(err).__name__})") from None
