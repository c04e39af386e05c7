"""Model card (README.md) of an exported looped model."""

from __future__ import annotations

import json
import os

# name, arXiv id, BibTeX of the paper behind each architecture (specs' "Sources" sections)
PAPERS = {
    "tah2": (
        "Improving Test-Time Scaling with Adaptive Looped Transformers",
        "2609.35748",
        "@article{you2026tah2,\n"
        "  title   = {Improving Test-Time Scaling with Adaptive Looped Transformers},\n"
        "  author  = {You and Fu and Feng and Lv and Ning and Ding and Wang},\n"
        "  journal = {arXiv preprint arXiv:2609.35748},\n"
        "  year    = {2026}\n"
        "}",
    ),
    "spiralformer": (
        "SpiralFormer: Looped Transformers Can Learn Hierarchical Dependencies via Multi-Resolution Recursion",
        "2602.11698",
        "@article{yu2026spiralformer,\n"
        "  title   = {SpiralFormer: Looped Transformers Can Learn Hierarchical Dependencies via Multi-Resolution "
        "Recursion},\n"
        "  author  = {Yu and Shu and Wang and Zhang and Wu and Wu and Long and Chen and Xu and Su and Zheng},\n"
        "  journal = {arXiv preprint arXiv:2602.11698},\n"
        "  year    = {2026}\n"
        "}",
    ),
    "sgt": (
        "Sparse Growing Transformer: Training-Time Sparse Depth Allocation via Progressive Attention Looping",
        "2603.23998",
        "@article{chen2026sgt,\n"
        "  title   = {Sparse Growing Transformer: Training-Time Sparse Depth Allocation via Progressive Attention "
        "Looping},\n"
        "  author  = {Chen, Yao and Chen, Yilong and Yang, Yinqi and Shang, Junyuan and Zhang, Zhenyu and Zhang, Zefeng "
        "and Nie, Shuaiyi and Wang, Shuohuan and Sun, Yu and Wu, Hua and Wang, HaiFeng and Liu, Tingwen},\n"
        "  journal = {arXiv preprint arXiv:2603.23998},\n"
        "  year    = {2026}\n"
        "}",
    ),
}

ARCH_TITLES = {
    "tah2": "TaH2 (adaptive looped Qwen3: updater, decider, stopping-weighted mixture, duo-causal attention)",
    "spiralformer": "SpiralFormer (pre → shared core × T at coarse-to-fine resolutions → post)",
    "sgt": "SGT — Sparse Growing Transformer (head-level attention loops in a few layers)",
}

# config fields worth a line in the card, per architecture
SUMMARY_FIELDS = {
    "tah2": ["max_iterations", "exit_threshold", "iteration_attention", "mixture", "updater", "decider",
             "updater_intermediate_size", "decider_intermediate_size", "decider_topk"],
    "spiralformer": ["conversion_layer_map", "num_pre_layers", "num_loop_layers", "num_post_layers", "chunk_sizes",
                     "topology",
                     "downscale", "upscale", "core_output", "router_init"],
    "sgt": ["loop_mode", "loop_plan", "heads_per_layer", "max_loop_depth"],
}
BACKBONE_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "tie_word_embeddings"]


def _fmt(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)


def render_model_card(model, source: str | None = None, report: dict | None = None, license: str = "apache-2.0",
                      repo_id: str | None = None, title: str | None = None) -> str:
    """README.md text: architecture, source checkpoint, config summary, parameter counts, parity, usage, licence,
    citation. `report` is `conversion_report(...)`'s dict (parameter counts and the 1-loop parity)."""
    cfg = model.config
    arch = cfg.model_type
    paper, arxiv, bibtex = PAPERS.get(arch, ("", "", ""))
    report = dict(report or {})
    params = report.get("params", sum(p.numel() for p in model.parameters()))
    name = repo_id or "path/to/this/checkpoint"
    front = ["---", f"license: {license}", "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", "- hf_loops", f"- {arch}", "- looped-transformer"]
    if source and source.count("/") == 1 and not os.path.exists(source):  # a Hub id, not a local path
        front += [f"base_model: {source}"]
    front += ["---", ""]
    lines = [f"# {title or name.rsplit('/', 1)[-1]}", "",
             f"**Architecture:** {ARCH_TITLES.get(arch, arch)} — `model_type: {arch}`, class "
             f"`{type(model).__name__}`.", ""]
    if paper:
        lines += [f"Paper: *{paper}*, [arXiv:{arxiv}](https://arxiv.org/abs/{arxiv}).", ""]
    lines += [f"**Source checkpoint:** `{source}`" if source else "**Source checkpoint:** (not recorded)",
              "", "Converted with `hf_loops` (`convert_qwen3`): the Qwen3 weights keep their "
              "state-dict names; modules the architecture adds are freshly initialised (see the config summary).", ""]
    lines += ["## Configuration", "", "| field | value |", "|---|---|"]
    for key in SUMMARY_FIELDS.get(arch, []) + BACKBONE_FIELDS:
        if hasattr(cfg, key):
            lines.append(f"| `{key}` | `{_fmt(getattr(cfg, key))}` |")
    lines += ["", "## Parameters", "", "| | count |", "|---|---|"]
    if "source_params" in report:
        lines.append(f"| source | {report['source_params']:,} |")
    lines.append(f"| this model | {params:,} |")
    if "added_params" in report:
        lines.append(f"| added by the conversion | {report['added_params']:,} |")
    lines += ["", "## Parity with the source", ""]
    if report.get("parity_max_abs_diff") is not None:
        lines.append(f"With the loop switched off ({report.get('parity_setting', 'one pass')}) the logits differ from "
                     f"the source's by at most **{report['parity_max_abs_diff']:.3g}** (max-abs over "
                     f"{report.get('parity_prompts', 'a few')} prompts, dtype {report.get('dtype', '?')}).")
    else:
        lines.append(report.get("parity_note") or "Not measured.")
    lines += ["", "## Usage", "", "```python", "import torch",
              "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)  '
              "# or `import hf_loops` first",
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              'ids = tokenizer("Looped transformers think harder on hard tokens.", return_tensors="pt").input_ids',
              "out = model.generate(ids, max_new_tokens=32, do_sample=False)",
              "print(tokenizer.decode(out[0], skip_special_tokens=True))", "```", "",
              "The modeling code ships with the checkpoint (`trust_remote_code=True`); with `hf_loops` installed and "
              "imported, its classes are used instead.", "",
              "## Licence", "",
              f"`{license}` — the licence of the source checkpoint applies to the converted weights.", ""]
    if bibtex:
        lines += ["## Citation", "", "```bibtex", bibtex, "```", ""]
    return "\n".join(front + lines)
