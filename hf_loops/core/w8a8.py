"""A TaH2 or SGT checkpoint in the compressed-tensors W8A8 int8 format, the quantized format vLLM's CPU build serves.

    from hf_loops.core.w8a8 import save_w8a8_int8
    save_w8a8_int8(model, "tah2-w8a8")        # then vllm.LLM(model="tah2-w8a8") with the hf_loops plugin

Weights: the backbone's attention and MLP projections (q, k, v, o, gate, up, down of every layer) become int8 with one
symmetric scale per output channel (round to nearest: scale = max |w| over the row / 127). Activations: quantized per
token at run time by the engine (dynamic, symmetric), so the checkpoint carries no activation scale and the same
scheme applies at every executed depth of the loop: there is nothing to calibrate. Embeddings, the LM head, the norms
and the loop's control (TaH2's decider and updater) stay in the model's precision, as in the torchao policy of
`hf_loops.core.quantization` (a few weights each, and they decide how often the rest runs).

The files are the model's own `save_pretrained` output (config, generation config, remote code where the model has
it) with the weights replaced and `quantization_config` (quant_method "compressed-tensors", format "int-quantized")
added to config.json; vLLM reads it through its `CompressedTensorsConfig` and runs the projections with its
`CompressedTensorsW8A8Int8` scheme (`QKVParallelLinear` and the other parallel linear layers the plugin's models are
built from take it through `quant_config`). transformers itself loads such a checkpoint only with the
`compressed-tensors` package installed; hf_loops does not need it.
"""

from __future__ import annotations

import json
import os

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHS = ("tah2", "sgt")


def _args(strategy: str, dynamic: bool) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "actorder": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}}


def w8a8_quantization_config() -> dict:
    """config.json's `quantization_config`: every Linear, int8 per-channel weights, int8 per-token dynamic inputs."""
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args("channel", False),
                                          "input_activations": _args("token", True), "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale (out, 1) in float32): symmetric round to nearest, one scale per output row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def is_projection(name: str) -> bool:
    """A backbone attention / MLP projection weight (`model.layers.N.*.<proj>.weight`): the ones quantized."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def save_w8a8_int8(model, out_dir: str, overwrite: bool = False, tokenizer=None) -> str:
    """Write `model` (a TaH2 or SGT `...ForCausalLM`) to `out_dir` as a W8A8 int8 compressed-tensors checkpoint
    (with `tokenizer` when given); atomic: `out_dir` is complete or absent. Returns `out_dir`."""
    from safetensors.torch import save_file

    from .outdir import atomic_output_dir

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHS:
        raise ValueError(f"save_w8a8_int8: model must be a TaH2 or SGT model (model_type one of {ARCHS}), got "
                         f"{model_type!r}")
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise ValueError(f"save_w8a8_int8: model must hold float weights (float32, bfloat16 or float16), got "
                         f"{sorted(map(str, dtypes))}: is it quantized already?")
    with atomic_output_dir(out_dir, "W8A8 export", overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        for name in os.listdir(tmp):  # the float weights (one file or shards and their index) are replaced
            if name.endswith(".safetensors") or name == "model.safetensors.index.json":
                os.remove(os.path.join(tmp, name))
        tensors = {}
        for name, t in model.state_dict().items():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            if is_projection(name):
                q, scale = quantize_rows(t)
                tensors[name] = q
                tensors[name[: -len("weight")] + "weight_scale"] = scale.to(t.dtype)
            else:
                tensors[name] = t.detach().contiguous()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        path = os.path.join(tmp, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["quantization_config"] = w8a8_quantization_config()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out_dir


__all__ = ["ARCHS", "PROJECTIONS", "is_projection", "quantize_rows", "save_w8a8_int8", "w8a8_quantization_config"]
