"""The architectures hf_loops retrofits Qwen3 into: one `ArchitectureSpec` each, the one place their facts live.

Conversion (`convert_qwen3`), the conversion report (1-loop parity), the model card, the CLI's choices, FLOPs
accounting, display names and the analysis (trace adapters) read these entries; nothing else branches on an architecture's name. A fourth architecture is one
configuration file, one modeling file and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.trace_adapters import SGTTraceAdapter, SpiralFormerTraceAdapter, TaH2TraceAdapter
from ..modeling.configuration_sgt import SGTConfig
from ..modeling.configuration_spiralformer import SpiralFormerConfig
from ..modeling.configuration_tah2 import TaH2Config
from ..modeling.modeling_sgt import SGTForCausalLM
from ..modeling.modeling_spiralformer import SpiralFormerForCausalLM
from ..modeling.modeling_tah2 import TaH2ForCausalLM
from .sgt import calibrate_sgt, sgt_one_loop_logits
from .spiralformer import convert_spiralformer, spiralformer_one_loop_logits


@dataclass(frozen=True)
class ArchitectureSpec:
    """Everything the package knows about one looped architecture.

    name: `model_type`. title: one line for cards and help. paper/arxiv/bibtex: the paper behind it.
    summary_fields: config fields worth a line in the model card.
    new_module_prefixes: state-dict prefixes of the modules a Qwen3 checkpoint does not have (freshly initialised).
    one_loop_logits(model, ids, source_num_layers) → (logits, None) with the loop switched off (must equal the source
        Qwen3's), or (None, reason). parity_setting: how the loop is switched off, in words.
    reports_depth: the model returns a per-token depth (`iter_counts`).
    build(source, dtype, layer_map=..., core_init=..., **config_overrides): a converter for architectures whose weights
        are not a key-preserving load of Qwen3's (None: the shared key-preserving load).
    convert_options: `convert_qwen3` keywords only this architecture takes.
    finish(model, calibration=..., tokenizer=...): a step after the load (SGT's entropy calibration).
    import_native(source_dir, allow_pickle, **config_overrides): a model from a directory already in the
        architecture's own published layout (the authors' TaH2 checkpoints), or None when it is not one.
    flops: the architecture's FLOPs module (`hf_loops.core.flops_*`), imported on first use.
    display(config): the name of a model of this architecture in tables ("TaH2 (M=2)"); None: `short_name`.
    short_name: the architecture's name in words ("SpiralFormer").
    trace_adapter: the class that maps the model's layer calls to trace steps (`hf_loops.core.trace_adapters`);
        None: the plain decoder stack's.
    cross_iteration_attention: attention keys span the streams of every depth (TaH2's duo-causal attention), so the
        analysis measures how much attention goes to earlier depths.
    """

    name: str
    config_class: type
    model_class: type
    title: str
    paper: str
    arxiv: str
    bibtex: str
    summary_fields: tuple[str, ...]
    new_module_prefixes: tuple[str, ...]
    one_loop_logits: Callable
    parity_setting: str
    reports_depth: bool = False
    build: Callable | None = None
    convert_options: tuple[str, ...] = ()
    finish: Callable | None = None
    import_native: Callable | None = None
    flops_module: str = ""
    display: Callable | None = None
    short_name: str = ""
    trace_adapter: type | None = None
    cross_iteration_attention: bool = False

    @property
    def flops(self):
        import importlib

        return importlib.import_module(self.flops_module, __package__) if self.flops_module else None


def _tah2_display(config) -> str:
    """Standard (M=1): the one-pass baseline; TaH2 / TaH2-fixed (always continue) / TaH2-<decider> with its M."""
    if config.max_iterations == 1:
        return "Standard (M=1)"
    decider = getattr(config, "decider", "")
    kind = {"learned": "TaH2", "always": "TaH2-fixed"}.get(decider, f"TaH2-{decider}")
    return f"{kind} (M={config.max_iterations})"


@torch.no_grad()
def _tah2_one_loop_logits(model, ids, source_num_layers):
    return model(ids, max_iterations=1, use_cache=False).logits, None


def _tah2_import_native(source_dir, allow_pickle=False, **config_overrides):
    from .checks import check_safetensors_files
    from .tah2_official import import_tah2, is_official_tah2_dir

    if not is_official_tah2_dir(source_dir):
        return None
    check_safetensors_files(source_dir)
    return import_tah2(source_dir, allow_pickle=allow_pickle, **config_overrides)


def _sgt_finish(model, calibration=None, tokenizer=None):
    if calibration is not None:
        calibrate_sgt(model, calibration, tokenizer)
    return model


def _bibtex(key: str, title: str, authors: str, arxiv: str) -> str:
    return (f"@article{{{key},\n  title   = {{{title}}},\n  author  = {{{authors}}},\n"
            f"  journal = {{arXiv preprint arXiv:{arxiv}}},\n  year    = {{2026}}\n}}")


_TAH2_TITLE = "Improving Test-Time Scaling with Adaptive Looped Transformers"
_SPIRAL_TITLE = "SpiralFormer: Looped Transformers Can Learn Hierarchical Dependencies via Multi-Resolution Recursion"
_SGT_TITLE = "Sparse Growing Transformer: Training-Time Sparse Depth Allocation via Progressive Attention Looping"

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "tah2": ArchitectureSpec(
        name="tah2", config_class=TaH2Config, model_class=TaH2ForCausalLM,
        title="TaH2 (adaptive looped Qwen3: updater, decider, stopping-weighted mixture, duo-causal attention)",
        paper=_TAH2_TITLE, arxiv="2609.35748",
        bibtex=_bibtex("you2026tah2", _TAH2_TITLE, "You and Fu and Feng and Lv and Ning and Ding and Wang",
                       "2609.35748"),
        summary_fields=("max_iterations", "exit_threshold", "iteration_attention", "mixture", "updater", "decider",
                        "updater_intermediate_size", "decider_intermediate_size", "decider_topk", "loop_span",
                        "core_adapter", "exit_kv_fill"),
        new_module_prefixes=("updater.", "decider.", "core_adapter."),
        one_loop_logits=_tah2_one_loop_logits, parity_setting="max_iterations=1", reports_depth=True,
        import_native=_tah2_import_native, flops_module="..core.flops_tah2", display=_tah2_display,
        short_name="TaH2", trace_adapter=TaH2TraceAdapter, cross_iteration_attention=True,
    ),
    "spiralformer": ArchitectureSpec(
        name="spiralformer", config_class=SpiralFormerConfig, model_class=SpiralFormerForCausalLM,
        title="SpiralFormer (pre → shared core × T at coarse-to-fine resolutions → post)",
        paper=_SPIRAL_TITLE, arxiv="2602.11698",
        bibtex=_bibtex("yu2026spiralformer", _SPIRAL_TITLE,
                       "Yu and Shu and Wang and Zhang and Wu and Wu and Long and Chen and Xu and Su and Zheng",
                       "2602.11698"),
        summary_fields=("conversion_layer_map", "num_pre_layers", "num_loop_layers", "num_post_layers",
                        "chunk_sizes", "topology", "downscale", "upscale", "core_output", "router_init"),
        new_module_prefixes=("model.scorers.", "model.allocators.", "model.routers."),
        one_loop_logits=spiralformer_one_loop_logits, parity_setting="chunk_sizes=[1], one core pass",
        build=convert_spiralformer, convert_options=("layer_map", "core_init"),
        flops_module="..core.flops_spiralformer", short_name="SpiralFormer", trace_adapter=SpiralFormerTraceAdapter,
    ),
    "sgt": ArchitectureSpec(
        name="sgt", config_class=SGTConfig, model_class=SGTForCausalLM,
        title="SGT — Sparse Growing Transformer (head-level attention loops in a few layers)",
        paper=_SGT_TITLE, arxiv="2603.23998",
        bibtex=_bibtex("chen2026sgt", _SGT_TITLE,
                       "Chen, Yao and Chen, Yilong and Yang, Yinqi and Shang, Junyuan and Zhang, Zhenyu and Zhang, "
                       "Zefeng and Nie, Shuaiyi and Wang, Shuohuan and Sun, Yu and Wu, Hua and Wang, HaiFeng and Liu, "
                       "Tingwen", "2603.23998"),
        summary_fields=("loop_mode", "loop_plan", "heads_per_layer", "max_loop_depth"),
        new_module_prefixes=(),  # SGT adds no parameters
        one_loop_logits=sgt_one_loop_logits, parity_setting="loop depths 0",
        convert_options=("calibration",), finish=_sgt_finish, flops_module="..core.flops_sgt", short_name="SGT",
        trace_adapter=SGTTraceAdapter,
    ),
}


def display_name(config) -> str:
    """The display name of a model with `config`: its architecture's (`ArchitectureSpec.display`), "Qwen3" for the
    plain source models, the model_type otherwise."""
    model_type = getattr(config, "model_type", "")
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        return {"qwen3": "Qwen3"}.get(model_type, model_type)
    return spec.display(config) if spec.display is not None else spec.short_name or spec.name


def get_spec(arch: str) -> ArchitectureSpec:
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}") from None


def get_architecture(arch: str) -> tuple[type, type]:
    """(config class, causal-LM class) of `arch`."""
    spec = get_spec(arch)
    return spec.config_class, spec.model_class
