"""Qwen3 → SpiralFormer (docs/spiralformer.md, docs/conversion.md).

Which source layers become what is explicit:

    layer_map = {"pre": [0, 1], "core": [2, 3], "post": [4, 5]}

lists source layer indices (0-based). `model.layers` of the result is pre + core + post in that order; the core is
run once per entry of `chunk_sizes`. A core entry may also be a list of source layers, whose weights are averaged
(`core_init="average"` of the spec), e.g. `"core": [[2, 4], [3, 5]]`. Source layers not listed are dropped.

Without `layer_map`, give the counts `num_pre_layers`, `num_loop_layers`, `num_post_layers`: pre = the first
N_pre source layers, post = the last N_post, core = the N_loop-layer block in the middle of the remaining span
(`core_init="select"`, default) or, with `core_init="average"`, the remaining span cut into consecutive N_loop-layer
blocks averaged position-wise. Without either, every source layer is kept: pre = L//4, post = L//4, core = the rest.

Retrofit defaults (overridable): `core_output="delta"`, `router_init="identity"`, `depth_scaled_init=False`, so that
with `chunk_sizes=[1]` and every source layer kept in order the logits equal the source's (anchor: exactly; MeSH with
identity routers: ≤ 1e-5 in fp32). New modules (scorers, allocators, routers) are initialised by the model's
`_init_weights` (zeros / identity routers).
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedModel

from ..modeling.configuration_spiralformer import SpiralFormerConfig
from ..modeling.modeling_spiralformer import SpiralFormerForCausalLM
from .qwen3_source import cast_model, qwen3_config_fields

RETROFIT_DEFAULTS = {"core_output": "delta", "router_init": "identity", "depth_scaled_init": False}
NEW_MODULE_PREFIXES = ("model.scorers.", "model.allocators.", "model.routers.")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _check_indices(name: str, values, num_layers: int) -> list:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"layer_map[{name!r}] must be a list of source layer indices, got {values!r}")
    out = []
    for v in values:
        group = list(v) if isinstance(v, (list, tuple)) else [v]
        if name != "core" and len(group) != 1:
            raise ValueError(f"layer_map[{name!r}] entries must be single layer indices, got {v!r}")
        if not group:
            raise ValueError(f"layer_map[{name!r}] has an empty group")
        for i in group:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
                raise ValueError(
                    f"layer_map[{name!r}] indices must be integers in [0, {num_layers}) (the source has {num_layers} "
                    f"layers), got {i!r}"
                )
        out.append(group if name == "core" else group[0])
    return out


def resolve_layer_map(num_source_layers: int, layer_map: dict | None = None, num_pre_layers: int | None = None,
                      num_loop_layers: int | None = None, num_post_layers: int | None = None,
                      core_init: str = "select") -> dict:
    """{"pre": [i…], "core": [[j…]…], "post": [k…]} (core entries are groups averaged into one layer)."""
    L = num_source_layers
    if core_init not in ("select", "average"):
        raise ValueError(f"core_init must be 'select' or 'average', got {core_init!r}")
    if layer_map is not None:
        if any(c is not None for c in (num_pre_layers, num_loop_layers, num_post_layers)):
            raise ValueError("give either layer_map or num_pre_layers/num_loop_layers/num_post_layers, not both")
        if not isinstance(layer_map, dict) or set(layer_map) - {"pre", "core", "post"} or "core" not in layer_map:
            raise ValueError(f"layer_map must be a dict with keys 'pre', 'core', 'post' ('core' required), "
                             f"got {layer_map!r}")
        pre = _check_indices("pre", layer_map.get("pre", []), L)
        core = _check_indices("core", layer_map["core"], L)
        post = _check_indices("post", layer_map.get("post", []), L)
        if not core:
            raise ValueError("layer_map['core'] must list at least one source layer")
        return {"pre": pre, "core": core, "post": post}
    counts = (num_pre_layers, num_loop_layers, num_post_layers)
    if all(c is None for c in counts):
        p = c = L // 4
        n = L - p - c
    elif any(c is None for c in counts):
        raise ValueError(f"num_pre_layers, num_loop_layers and num_post_layers must be given together, got {counts}")
    else:
        p, n, c = counts
    for name, v, lo in (("num_pre_layers", p, 0), ("num_loop_layers", n, 1), ("num_post_layers", c, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if p + n + c > L:
        raise ValueError(f"num_pre_layers + num_loop_layers + num_post_layers = {p + n + c} exceeds the source's "
                         f"{L} layers")
    middle = list(range(p, L - c))  # the span the core replaces
    if core_init == "average":
        if len(middle) % n:
            raise ValueError(f"core_init='average' needs the {len(middle)} middle source layers to split into blocks "
                             f"of num_loop_layers={n}")
        core = [[middle[b + l] for b in range(0, len(middle), n)] for l in range(n)]
    else:
        start = (len(middle) - n) // 2
        core = [[i] for i in middle[start : start + n]]
    return {"pre": list(range(p)), "core": core, "post": list(range(L - c, L))}


def keeps_every_layer_in_order(mapping: dict, num_source_layers: int) -> bool:
    flat = mapping["pre"] + [g[0] for g in mapping["core"] if len(g) == 1] + mapping["post"]
    return all(len(g) == 1 for g in mapping["core"]) and flat == list(range(num_source_layers))


def convert_spiralformer(source: PreTrainedModel, layer_map: dict | None = None, core_init: str = "select",
                         **overrides) -> SpiralFormerForCausalLM:
    """`source`: a loaded `Qwen3ForCausalLM`. See the module docstring for `layer_map` / counts / `core_init`."""
    src_cfg = source.config
    L = src_cfg.num_hidden_layers
    counts = {k: overrides.pop(k, None) for k in ("num_pre_layers", "num_loop_layers", "num_post_layers")}
    mapping = resolve_layer_map(L, layer_map, core_init=core_init, **counts)
    order = mapping["pre"] + mapping["core"] + mapping["post"]  # target layer t ← source group(s)
    fields = qwen3_config_fields(src_cfg)
    for key in ("layer_types", "num_hidden_layers"):
        fields.pop(key, None)
    kwargs = dict(RETROFIT_DEFAULTS)
    kwargs.update(overrides)
    config = SpiralFormerConfig(
        **fields, num_hidden_layers=len(order), num_pre_layers=len(mapping["pre"]),
        num_loop_layers=len(mapping["core"]), num_post_layers=len(mapping["post"]), **kwargs,
    )
    config.conversion_layer_map = {"pre": mapping["pre"], "core": mapping["core"], "post": mapping["post"]}

    src_state = source.state_dict()
    layers: dict[int, dict[str, torch.Tensor]] = {}
    state = {}
    for key, value in src_state.items():
        m = _LAYER_KEY.match(key)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = value
        else:
            state[key] = value
    for t, entry in enumerate(order):
        group = entry if isinstance(entry, list) else [entry]
        for name in layers[group[0]]:
            tensors = [layers[i][name] for i in group]
            if len(tensors) == 1:
                state[f"model.layers.{t}.{name}"] = tensors[0]
            else:
                state[f"model.layers.{t}.{name}"] = torch.stack([x.float() for x in tensors]).mean(0).to(tensors[0].dtype)

    dtype = next(source.parameters()).dtype
    model = cast_model(SpiralFormerForCausalLM(config), dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad_missing = [k for k in missing if not k.startswith(NEW_MODULE_PREFIXES)
                   and not (config.tie_word_embeddings and k == "lm_head.weight")]
    if bad_missing or unexpected:
        raise ValueError(f"source checkpoint does not match a Qwen3 backbone for arch 'spiralformer': unexpected keys "
                         f"{list(unexpected)[:5]}, missing keys {bad_missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def spiralformer_one_loop_logits(model, ids: torch.Tensor, source_num_layers: int):
    """The same weights with `chunk_sizes=[1]` (one core pass), `core_output="delta"` and identity MeSH routers:
    the source's logits when every source layer was kept in order (1-loop parity), else (None, reason)."""
    layer_map = getattr(model.config, "conversion_layer_map", None)
    if layer_map is not None:
        core = [g[0] if len(g) == 1 else None for g in layer_map["core"]]
        flat = list(layer_map["pre"]) + core + list(layer_map["post"])
    else:
        flat = list(range(model.config.num_hidden_layers))
    if flat != list(range(source_num_layers)):
        return None, "layers were dropped, averaged or reordered: the model has no source-equivalent pass"
    cfg = qwen3_config_fields(model.config)
    cfg.update(chunk_sizes=[1], core_output="delta", router_init="identity", mesh_slots=None)
    one = type(model.config)(**cfg)
    single = SpiralFormerForCausalLM(one).to(next(model.parameters()).dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.routers.")}
    single.load_state_dict(state, strict=False)
    if one.tie_word_embeddings:
        single.tie_weights()
    return single(ids, use_cache=False).logits, None
