"""SGT configuration: Qwen3 plus the loop plan and the growth knobs (docs/sgt.md).

An `SGTConfig` is a `Qwen3Config` with a new `model_type`, so a Qwen3 checkpoint loads key-preserving: SGT adds no
parameters. `loop_plan` is the static structure used at inference (which heads of which layer are looped and how
often); the growth fields drive `SGTGrowthCallback` (Algorithm 1) during training and are ignored by the model itself.
"""

from __future__ import annotations

from typing import Literal

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .loop_utils import check_choice_fields, check_int_field, validated_at_load


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layer_list(name: str, value, num_layers: int) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"SGTConfig.{name} must be a list of layer indices in [0, {num_layers}), got {value!r}")
    out = []
    for layer in value:
        if not _is_int(layer) or not 0 <= layer < num_layers:
            raise ValueError(f"SGTConfig.{name} entries must be layer indices in [0, {num_layers}), got {layer!r}")
        if layer in out:
            raise ValueError(f"SGTConfig.{name} has duplicate layer {layer}")
        out.append(layer)
    return out


def normalize_loop_plan(plan, num_layers: int, num_heads: int) -> list[dict]:
    """Validate a loop plan and return its canonical form: a list of `{"layer", "heads", "depth"}` sorted by layer.

    Accepted inputs: None / [] / {} (no loops); a list of `{"layer": int, "heads": [int, ...], "depth": int}`; or the
    mapping form `{"<layer>": {"heads": [...], "depth": K}}`. Heads are 0-based query-head indices, unique, in
    [0, num_attention_heads); depth is the number of extra attention loops K_l >= 0 (0 = the layer is not looped).
    """
    if plan is None:
        return []
    if isinstance(plan, dict):
        entries = []
        for key, value in plan.items():
            if not isinstance(value, dict):
                raise ValueError(f"SGTConfig.loop_plan[{key!r}] must be a dict with 'heads' and 'depth', got {value!r}")
            try:
                layer = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"SGTConfig.loop_plan keys must be layer indices, got {key!r}") from None
            entries.append({"layer": layer, **value})
    elif isinstance(plan, (list, tuple)):
        entries = list(plan)
    else:
        raise ValueError(f"SGTConfig.loop_plan must be None, a list of {{layer, heads, depth}} or a dict, got {plan!r}")

    out, seen = [], set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"layer", "heads", "depth"} or not {"layer", "heads"} <= set(entry):
            raise ValueError(
                f"SGTConfig.loop_plan entries must be dicts with keys 'layer', 'heads' and 'depth', got {entry!r}"
            )
        layer, heads, depth = entry["layer"], entry["heads"], entry.get("depth", 1)
        if not _is_int(layer) or not 0 <= layer < num_layers:
            raise ValueError(f"SGTConfig.loop_plan layer must be in [0, {num_layers}) (num_hidden_layers), got {layer!r}")
        if layer in seen:
            raise ValueError(f"SGTConfig.loop_plan lists layer {layer} twice")
        seen.add(layer)
        if not _is_int(depth) or depth < 0:
            raise ValueError(f"SGTConfig.loop_plan depth of layer {layer} must be an integer >= 0, got {depth!r}")
        if not isinstance(heads, (list, tuple)) or (depth > 0 and len(heads) == 0):
            raise ValueError(f"SGTConfig.loop_plan heads of layer {layer} must be a non-empty list, got {heads!r}")
        for h in heads:
            if not _is_int(h) or not 0 <= h < num_heads:
                raise ValueError(
                    f"SGTConfig.loop_plan head index of layer {layer} must be in [0, {num_heads}) "
                    f"(num_attention_heads), got {h!r}"
                )
        if len(set(heads)) != len(heads):
            raise ValueError(f"SGTConfig.loop_plan heads of layer {layer} must be unique, got {list(heads)}")
        out.append({"layer": layer, "heads": sorted(int(h) for h in heads), "depth": int(depth)})
    return sorted(out, key=lambda e: e["layer"])


class SGTConfig(Qwen3Config):
    r"""
    Configuration of a Sparse Growing Transformer on a Qwen3 backbone.

    Args (in addition to `Qwen3Config`'s):
        loop_plan (`list[dict]`, None): static structure: for each looped layer `{"layer": l, "heads": [h, ...],
            "depth": K_l}`; only the attention sub-layer of layer l is re-applied K_l extra times, and only for the
            listed (kept) heads. None / [] = plain Qwen3. The mapping form `{"<l>": {"heads", "depth"}}` is accepted
            and normalised to the list form.
        loop_mode (`str`, "heads"): "heads" (SGT head-level attention loops from `loop_plan`) or "block" (the Block Loop
            baseline: whole blocks of `block_loop_layers` are applied `block_loop_depth` extra times; `loop_plan` must
            then be empty).
        block_loop_layers (`list[int]`, []), block_loop_depth (`int`, 1): the Block Loop baseline's layers and extra
            applications.
        growth_start (`int`, 250): first selection step t_s (Algorithm 1).
        growth_window (`int`, 250): window Δt of head-gate decay and between growth decisions.
        growth_top_layers (`int`, 3): number of top mean-entropy layers considered at each decision.
        growth_max_layers (`int`, 3): budget L_max of looped layers.
        heads_per_layer (`int`, 2): kept heads h per looped layer.
        max_loop_depth (`int`, 1): K_max, the largest number of extra loops a layer can grow to.
        entropy_ema (`float`, 0.5): β of the EMA of the per-head entropies, in [0, 1).
        growth_exclude_layers (`list[int]`, [0]): layers never selected.
        head_decay (`str`, "linear"): gate decay of non-kept heads over the window: "linear" or "cosine".
        head_keep_schedule (`list[int]`, [heads_per_layer]): heads kept at each stage of head selection, strictly
            decreasing and ending at `heads_per_layer`. The default is the released code's single stage; **[10, 2] is
            the paper's setting**: SELECT keeps the top 10 heads (the other gates decay over one window), that
            window's end re-ranks the 10 by their loop entropy and keeps 2 (the other 8 decay over the next window),
            delaying the next layer by one window. Calibration runs the same stages, one measurement each.
        entropy_estimator (`str`, "last_row"): "last_row" (official: the last valid query row) or "sampled_rows" (the
            last valid row plus stratified rows, `entropy_sample_rows` in total).
        entropy_sample_rows (`int`, 8): rows per sequence for "sampled_rows".
        growth_direction (`str`, "deep_to_shallow"): order in which layers are added (the paper); "shallow_to_deep"
            is the paper's ablation.
        head_selection (`str`, "highest_entropy"): which heads (and layers) are looped: the highest-entropy ones (the
            paper) or, for the ablation, "lowest_entropy".
    """

    model_type = "sgt"

    loop_plan: list | dict | None = None
    loop_mode: Literal["heads", "block"] = "heads"
    block_loop_layers: list | None = None
    block_loop_depth: int = 1
    growth_start: int = 250
    growth_window: int = 250
    growth_top_layers: int = 3
    growth_max_layers: int = 3
    heads_per_layer: int = 2
    max_loop_depth: int = 1
    entropy_ema: float = 0.5
    growth_exclude_layers: list | None = None
    head_decay: Literal["linear", "cosine"] = "linear"
    head_keep_schedule: list | None = None
    entropy_estimator: Literal["last_row", "sampled_rows"] = "last_row"
    growth_direction: Literal["deep_to_shallow", "shallow_to_deep"] = "deep_to_shallow"
    head_selection: Literal["highest_entropy", "lowest_entropy"] = "highest_entropy"
    entropy_sample_rows: int = 8

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_loop_fields()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`from_pretrained(..., loop_plan=...)` sets load-time values after `__init__`: validate them too."""
        return validated_at_load(super().from_dict(config_dict, **kwargs))

    def check_loop_fields(self) -> None:
        """Validate (and canonicalise) every SGT field; ValueError naming the field."""
        num_layers, num_heads = self.num_hidden_layers, self.num_attention_heads
        check_choice_fields(self)
        for name in ("growth_start", "growth_window", "growth_top_layers", "growth_max_layers", "max_loop_depth",
                     "entropy_sample_rows"):
            check_int_field(self, name, 1)
        check_int_field(self, "block_loop_depth", 0)
        check_int_field(self, "heads_per_layer", 1, num_heads)
        if isinstance(self.entropy_ema, bool) or not isinstance(self.entropy_ema, (int, float)) \
                or not 0.0 <= float(self.entropy_ema) < 1.0:
            raise ValueError(f"SGTConfig.entropy_ema must be a float in [0, 1), got {self.entropy_ema!r}")
        self.entropy_ema = float(self.entropy_ema)

        self.growth_exclude_layers = _check_layer_list(
            "growth_exclude_layers", [0] if self.growth_exclude_layers is None else self.growth_exclude_layers,
            num_layers,
        )
        self.block_loop_layers = sorted(
            _check_layer_list("block_loop_layers", [] if self.block_loop_layers is None else self.block_loop_layers,
                              num_layers)
        )

        schedule = [self.heads_per_layer] if self.head_keep_schedule is None else self.head_keep_schedule
        if not isinstance(schedule, (list, tuple)) or not schedule:
            raise ValueError(f"SGTConfig.head_keep_schedule must be a non-empty list of ints, got {schedule!r}")
        for i, n in enumerate(schedule):
            if not _is_int(n) or not 1 <= n <= num_heads:
                raise ValueError(
                    f"SGTConfig.head_keep_schedule entries must be integers in [1, {num_heads}], got {n!r}"
                )
            if i and n >= schedule[i - 1]:
                raise ValueError(f"SGTConfig.head_keep_schedule must be strictly decreasing, got {list(schedule)}")
        if schedule[-1] != self.heads_per_layer:
            raise ValueError(
                f"SGTConfig.head_keep_schedule must end with heads_per_layer={self.heads_per_layer}, "
                f"got {list(schedule)}"
            )
        self.head_keep_schedule = [int(n) for n in schedule]

        self.loop_plan = normalize_loop_plan(self.loop_plan, num_layers, num_heads)
        if self.loop_mode == "block" and any(e["depth"] > 0 for e in self.loop_plan):
            raise ValueError("SGTConfig.loop_plan must be empty when loop_mode='block' (use block_loop_layers)")
