"""Export a looped model as a self-contained checkpoint: weights, config with `auto_map`, and the modeling files
copied flat, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works where hf_loops is absent."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile

from transformers import GenerationConfig, PreTrainedModel

from ..core.outdir import TMP_PREFIX, atomic_output_dir, check_output_dir, move_files_into, remove_stale_exports

__all__ = ["TMP_PREFIX", "atomic_output_dir", "check_output_dir", "export", "hub_token_ids", "move_files_into",
           "push_to_hub", "remote_code_saving", "remove_stale_exports", "save_hub_files"]

def _auto_map_entry(cls: type) -> str:
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


@contextlib.contextmanager
def remote_code_saving(model: PreTrainedModel, model_cls: type | None = None):
    """Within the block, `save_pretrained` writes `auto_map` (AutoConfig, AutoModel, AutoModelForCausalLM) and copies
    the modeling files. `register_for_auto_class` is undone on exit, so later saves in the process stay plain.
    `model_cls`: the class to register when it is not `type(model)` (a model whose class FSDP2 swapped)."""
    model_cls, config_cls = model_cls or type(model), type(model.config)
    base = getattr(model, model.base_model_prefix, None)
    base_cls = type(base) if isinstance(base, PreTrainedModel) else None
    had_auto_map = "auto_map" in model.config.__dict__
    old_auto_map = dict(model.config.auto_map) if had_auto_map and model.config.auto_map else None
    saved_auto = (config_cls._auto_class, model_cls._auto_class)
    try:
        config_cls.register_for_auto_class("AutoConfig")
        model_cls.register_for_auto_class("AutoModelForCausalLM")
        auto_map = dict(old_auto_map or {})
        if base_cls is not None:
            auto_map["AutoModel"] = _auto_map_entry(base_cls)
        model.config.auto_map = auto_map
        yield model
    finally:
        config_cls._auto_class, model_cls._auto_class = saved_auto
        if old_auto_map is not None:
            model.config.auto_map = old_auto_map
        elif "auto_map" in model.config.__dict__:
            del model.config.__dict__["auto_map"]


def export(model: PreTrainedModel, out_dir: str | os.PathLike, tokenizer=None, safe_serialization: bool = True, *,
           source: str | None = None, report: dict | None = None, license: str = "apache-2.0",
           repo_id: str | None = None, model_card: bool = True) -> str:
    """Write `model` (and `tokenizer`) to `out_dir` with remote code, a generation config and a model card.

    Files: weights, `config.json` with `auto_map`, the modeling files (flat), `generation_config.json`, the tokenizer
    files when a tokenizer is given, and `README.md` (architecture, `source`, config summary, parameter counts, the
    parity of `report` — see `conversion_report` —, usage, `license`, citation) unless `model_card=False`.

    The directory is written to a temporary sibling first and moved into place at the end, so a failure leaves
    nothing half-written.
    """
    out_dir = os.fspath(out_dir)
    with atomic_output_dir(out_dir, "export") as tmp:
        save_hub_files(model, tmp, tokenizer, safe_serialization, source=source, report=report, license=license,
                       repo_id=repo_id, model_card=model_card,
                       title=None if repo_id else os.path.basename(os.path.abspath(out_dir)))
    return out_dir


def save_hub_files(model: PreTrainedModel, folder: str, tokenizer=None, safe_serialization: bool = True, *,
                   source: str | None = None, report: dict | None = None, license: str = "apache-2.0",
                   repo_id: str | None = None, model_card: bool = True, title: str | None = None,
                   training: dict | None = None) -> None:
    """The files of a Hub-ready checkpoint, written into `folder` (the caller makes it atomic): what `export` and
    `hf-loops train` both write. A looped model gets `auto_map` and its modeling files (`remote_code_saving`); a class
    transformers ships (a Standard run's `Qwen3ForCausalLM`) is saved as transformers saves it. The saved `config.json` and `generation_config.json` follow one convention
    (`hub_token_ids`) and say `use_cache: true` (training turns the cache off); the model object is left as it was.
    `training`: the facts of a training run for the model card (see `render_model_card`)."""
    saved = (getattr(model, "generation_config", None),
             {k: model.config.__dict__[k] for k in ("eos_token_id", "pad_token_id", "use_cache")
              if k in model.config.__dict__})
    try:
        eos, pad, stops = hub_token_ids(model, tokenizer)
        model.config.eos_token_id, model.config.use_cache = eos, True
        if pad is not None:
            model.config.pad_token_id = pad
        model.generation_config = _export_generation_config(model, tokenizer, stops, pad)
        # A class transformers ships (the Qwen3ForCausalLM of a Standard run) is saved plain: no auto_map, no code.
        plain = type(model).__module__.startswith("transformers.")
        with contextlib.nullcontext(model) if plain else remote_code_saving(model):
            model.save_pretrained(folder, safe_serialization=safe_serialization)
    finally:
        model.generation_config = saved[0]
        for key in ("eos_token_id", "pad_token_id", "use_cache"):
            if key in saved[1]:
                setattr(model.config, key, saved[1][key])
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if model_card:
        from .model_card import render_model_card

        card = render_model_card(model, source=source, report=report, license=license, repo_id=repo_id,
                                 title=title, training=training)
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(card)


def _ids(value) -> list[int]:
    return [] if value is None else [int(value)] if isinstance(value, int) else [int(v) for v in value]


def hub_token_ids(model: PreTrainedModel, tokenizer=None) -> tuple[int | None, int | None, list[int]]:
    """The one end-of-sequence convention of every checkpoint we write (converted or trained), Qwen3's own: in
    `config.json` one `eos_token_id`, the tokenizer's end token (a chat model's `<|im_end|>`; the model's own when
    there is no tokenizer); in `generation_config.json` the list of every stop id — that token first, then the ones
    the model and its generation config already knew (a base model's `<|endoftext|>`), so generation stops at either.
    Returns (config eos, pad, generation stop ids)."""
    gen = getattr(model, "generation_config", None)
    known = _ids(getattr(model.config, "eos_token_id", None)) + _ids(getattr(gen, "eos_token_id", None))
    first = _ids(getattr(tokenizer, "eos_token_id", None))[:1] or known[:1]
    stops = list(dict.fromkeys(first + known))
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    return (stops[0] if stops else None), pad, stops


def _export_generation_config(model: PreTrainedModel, tokenizer=None, stops: list[int] | None = None,
                              pad: int | None = None) -> GenerationConfig:
    """A copy of the model's generation config with the stop ids and pad id of `hub_token_ids`, and a missing bos id
    from the model config, then the tokenizer (the model itself is left untouched)."""
    gen = getattr(model, "generation_config", None)
    gen = copy.deepcopy(gen) if gen is not None else GenerationConfig.from_model_config(model.config)
    if stops:
        gen.eos_token_id = list(stops)
    if pad is not None:
        gen.pad_token_id = pad
    if getattr(gen, "bos_token_id", None) is None:
        value = getattr(model.config, "bos_token_id", None)
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, "bos_token_id", None)
        if value is not None:
            gen.bos_token_id = value
    gen.use_cache = True
    return gen


def push_to_hub(model, repo_id: str, tokenizer=None, private: bool = False, token: str | None = None,
                commit_message: str | None = None, **card_info):
    """Export `model` (weights, config with `auto_map`, modeling code, generation config, tokenizer, model card) to a
    temporary directory and push it to `repo_id` in one commit. `card_info` goes to `export` (source, report, …)."""
    from .hub import push_folder

    tmp = tempfile.mkdtemp(prefix=".hf_loops_push_")
    try:
        folder = export(model, os.path.join(tmp, "export"), tokenizer=tokenizer, repo_id=repo_id, **card_info)
        return push_folder(folder, repo_id, private=private, token=token, commit_message=commit_message)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
