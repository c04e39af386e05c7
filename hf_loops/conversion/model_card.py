"""Model card (README.md) of an exported looped model."""

from __future__ import annotations

import json
import os

BACKBONE_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "tie_word_embeddings"]


def _fmt(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and name.count("/") == 1 and not os.path.exists(name)


def render_model_card(model, source: str | None = None, report: dict | None = None, license: str = "apache-2.0",
                      repo_id: str | None = None, title: str | None = None, training: dict | None = None) -> str:
    """README.md text: architecture, source checkpoint, config summary, parameter counts, parity, usage, licence,
    citation. `report` is `conversion_report(...)`'s dict (parameter counts and the 1-loop parity). `training`, for a
    trained model: {"trainer", "dataset", "dataset_split", "eval_dataset", "eval_split", "recipe", "steps", "epochs", "hyperparameters": {...},
    "metrics": {...}} (any may be missing), written as a Training section and front-matter fields."""
    from .registry import ARCHITECTURES

    cfg = model.config
    arch = cfg.model_type
    spec = ARCHITECTURES.get(arch)
    paper, arxiv, bibtex = (spec.paper, spec.arxiv, spec.bibtex) if spec is not None else ("", "", "")
    report = dict(report or {})
    params = report.get("params", sum(p.numel() for p in model.parameters()))
    name = repo_id or "path/to/this/checkpoint"
    training = dict(training or {})
    plain = spec is None  # a model transformers ships (the Qwen3 model of a Standard run): no loop, no remote code
    front = ["---", f"license: {license}", "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", "- hf_loops", f"- {arch}"] + ([] if plain else ["- looped-transformer"])
    if training:
        front += ["- trl", "- sft"]
    if _is_hub_id(source):  # a Hub id, not a local path
        front += [f"base_model: {source}"] + (["base_model_relation: finetune"] if training else [])
    hub_datasets = [d for d in (training.get("dataset"), training.get("eval_dataset")) if _is_hub_id(d)]
    if hub_datasets:
        front += ["datasets:"] + [f"- {d}" for d in dict.fromkeys(hub_datasets)]
    front += ["---", ""]
    lines = [f"# {title or name.rsplit('/', 1)[-1]}", "",
             f"**Architecture:** {spec.title if spec is not None else {'qwen3': 'Qwen3'}.get(arch, arch)} — "
             f"`model_type: {arch}`, class "
             f"`{type(model).__name__}`.", ""]
    if paper:
        lines += [f"Paper: *{paper}*, [arXiv:{arxiv}](https://arxiv.org/abs/{arxiv}).", ""]
    lines += [f"**Source checkpoint:** `{source}`" if source else "**Source checkpoint:** (not recorded)", ""]
    if training and plain:
        lines += [f"Post-trained with `hf-loops train --arch {training.get('arch', 'standard')}` "
                  f"(`{training.get('trainer', 'TaH2SFTTrainer')}`, one pass per token: the Standard baseline, M = 1) "
                  f"and saved as the plain `{type(model).__name__}` it computes: no loop, no remote code. See "
                  "Training below.", ""]
    elif training:
        lines += [f"Converted with `hf_loops` (`convert_qwen3`), then post-trained with `hf-loops train` "
                  f"(`{training.get('trainer', 'TaH2SFTTrainer')}`): see Training below.", ""]
    else:
        lines += ["Converted with `hf_loops` (`convert_qwen3`): the Qwen3 weights keep their state-dict names; modules "
                  "the architecture adds are freshly initialised (see the config summary).", ""]
    lines += ["## Configuration", "", "| field | value |", "|---|---|"]
    for key in list(spec.summary_fields if spec is not None else ()) + BACKBONE_FIELDS:
        if hasattr(cfg, key):
            lines.append(f"| `{key}` | `{_fmt(getattr(cfg, key))}` |")
    lines += ["", "## Parameters", "", "| | count |", "|---|---|"]
    if "source_params" in report:
        lines.append(f"| source | {report['source_params']:,} |")
    lines.append(f"| this model | {params:,} |")
    if "added_params" in report:
        lines.append(f"| added by the conversion | {report['added_params']:,} |")
    if training:
        lines += training_section(training)
    lines += ["", "## Parity with the source", ""]
    if training and report.get("parity_max_abs_diff") is None and not report.get("parity_note"):
        lines.append("Not measured: training changed the weights, so the converted model's parity no longer applies.")
    elif report.get("parity_max_abs_diff") is not None:
        lines.append(f"With the loop switched off ({report.get('parity_setting', 'one pass')}) the logits differ from "
                     f"the source's by at most **{report['parity_max_abs_diff']:.3g}** (max-abs over "
                     f"{report.get('parity_prompts', 'a few')} prompts, dtype {report.get('dtype', '?')}).")
    else:
        lines.append(report.get("parity_note") or "Not measured.")
    load = (f'model = AutoModelForCausalLM.from_pretrained("{name}")' if plain else
            f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)  '
            "# or `import hf_loops` first")
    lines += ["", "## Usage", "", "```python", "import torch",
              "from transformers import AutoModelForCausalLM, AutoTokenizer", "", load,
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              'ids = tokenizer("Looped transformers think harder on hard tokens.", return_tensors="pt").input_ids',
              "out = model.generate(ids, max_new_tokens=32, do_sample=False)",
              "print(tokenizer.decode(out[0], skip_special_tokens=True))", "```", "",
              f"A plain `{type(model).__name__}` checkpoint: transformers loads it without `hf_loops` or remote code."
              if plain else "The modeling code ships with the checkpoint (`trust_remote_code=True`); with `hf_loops` "
              "installed and imported, its classes are used instead.", "",
              "## Licence", "",
              f"`{license}` — the licence of the source checkpoint applies to the converted weights.", ""]
    if bibtex:
        lines += ["## Citation", "", "```bibtex", bibtex, "```", ""]
    return "\n".join(front + lines)


def training_section(training: dict) -> list[str]:
    """The Training section of a trained model's card: data, recipe, steps, hyper-parameters, final metrics."""
    lines = ["", "## Training", ""]
    for label, key, split in (("dataset", "dataset", "dataset_split"), ("evaluation dataset", "eval_dataset", "eval_split"),
                              ("recipe", "recipe", None), ("optimizer steps", "steps", None), ("epochs", "epochs", None)):
        if training.get(key) is not None:
            where = f" (split `{training[split]}`)" if split and training.get(split) and _is_hub_id(training[key]) else ""
            lines.append(f"- {label}: `{_fmt(training[key])}`{where}")
    if training.get("hyperparameters"):
        lines += ["", "| hyper-parameter | value |", "|---|---|"]
        lines += [f"| `{k}` | `{_fmt(v)}` |" for k, v in training["hyperparameters"].items()]
    if training.get("metrics"):
        lines += ["", "Final metrics:", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v:.6g} |" if isinstance(v, float) else f"| `{k}` | {_fmt(v)} |"
                  for k, v in training["metrics"].items()]
    return lines
