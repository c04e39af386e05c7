"""SpiralFormer configuration: Qwen3 plus the multi-resolution loop knobs (docs/spiralformer.md).

A `SpiralFormerConfig` is a `Qwen3Config` with a new `model_type`, so the Qwen3 parts keep their state-dict names.
`num_hidden_layers` counts the *physical* decoder layers (pre + core + post, the length of `model.layers`); the cache
holds one slot per *virtual* layer (pre + T·core + post) plus one decode-state slot per iteration, and the model
grows `cache.layers` to that size itself.
"""

from __future__ import annotations

import itertools
from typing import Literal

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .loop_utils import check_choice_fields, check_int_field, literal_choices, validated_at_load

QWEN3_DEFAULT_NUM_LAYERS = Qwen3Config.num_hidden_layers


# Baselines of the paper as configurations; layer counts are left to the caller.
SPIRALFORMER_PRESETS: dict[str, dict] = {
    "spiral-b": {"chunk_sizes": [8, 4, 2, 1]},
    "spiral-l": {"chunk_sizes": [16, 8, 4, 2]},
    "looped": {"chunk_sizes": [1, 1]},
}


class SpiralFormerConfig(Qwen3Config):
    r"""
    Configuration of a SpiralFormer: pre layers → shared core run once per resolution → post layers.

    Args (in addition to `Qwen3Config`'s):
        num_pre_layers, num_loop_layers, num_post_layers (`int`): the split of the physical layers; they must add up
            to `num_hidden_layers`. When all three are None the split is derived from `num_hidden_layers`
            (pre = post = num_hidden_layers // 4, core = the rest).
        chunk_sizes (`list[int]`, [8, 4, 2, 1]): chunk size g_t of every loop iteration, coarse → fine (non-increasing);
            T = its length.
        downscale (`str`, "self_aggregation"): tokens → chunk latent: learned within-chunk softmax or "mean".
        upscale (`str`, "output_dependent"): latent → tokens: learned allocation over the g readers or "uniform".
        topology (`str`, "mesh"): state carrier across iterations: MeSH slot buffer or "anchor" (h0 + update).
        mesh_slots (`int`, T + 3): number of MeSH buffer slots B (>= 2).
        shift (`str`, "overlap"): causal right shift s = g − 1 ("overlap") or s = g ("no_overlap").
        chunk_offset (`str`, "half"): chunk offset ω = g // 2 ("half") or 0 ("zero").
        shift_frame (`str`, "literal"): which tokens at the sequence start receive an update.
        latent_positions (`str`, "chunk_index"): RoPE position of latent j: j, last(j) ("last_token") or j·g.
        core_output (`str`, "state"): the core output ẑ ("state") or ẑ − z ("delta") feeds the update.
        router_init (`str`, "default"): MeSH routers with the default init or "identity" (all traffic to slot 1).
        scale_embeddings (`bool`, False): multiply the embeddings by √hidden_size.
        depth_scaled_init (`bool`, True): output projections' init std × 1/√(2·(pre + T·core + post)).
    """

    model_type = "spiralformer"

    num_pre_layers: int | None = None
    num_loop_layers: int | None = None
    num_post_layers: int | None = None
    chunk_sizes: list[int] | None = None
    downscale: Literal["self_aggregation", "mean"] = "self_aggregation"
    upscale: Literal["output_dependent", "uniform"] = "output_dependent"
    topology: Literal["mesh", "anchor"] = "mesh"
    mesh_slots: int | None = None
    shift: Literal["overlap", "no_overlap"] = "overlap"
    chunk_offset: Literal["half", "zero"] = "half"
    shift_frame: Literal["literal", "padded"] = "literal"
    latent_positions: Literal["chunk_index", "last_token", "chunk_start"] = "chunk_index"
    core_output: Literal["state", "delta"] = "state"
    router_init: Literal["default", "identity"] = "default"
    scale_embeddings: bool = False
    depth_scaled_init: bool = True

    def __post_init__(self, **kwargs):
        counts = (self.num_pre_layers, self.num_loop_layers, self.num_post_layers)
        if (self.num_hidden_layers == QWEN3_DEFAULT_NUM_LAYERS
                and all(isinstance(c, int) and not isinstance(c, bool) for c in counts)):
            # The three counts given without num_hidden_layers: derive the total rather than disagree with the
            # inherited default (a config that states num_hidden_layers = 32 explicitly and other counts is
            # indistinguishable and gets the derived total too).
            self.num_hidden_layers = sum(counts)
        self.check_loop_fields()
        super().__post_init__(**kwargs)
        if self.use_sliding_window:
            raise ValueError("SpiralFormerConfig.use_sliding_window must be False: chunk latents use full attention")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`from_pretrained(..., chunk_sizes=...)` sets load-time values after `__init__`: validate them too."""
        return validated_at_load(super().from_dict(config_dict, **kwargs))

    def check_loop_fields(self) -> None:
        """Validate (and complete) every SpiralFormer field; ValueError naming the field."""
        if self.chunk_sizes is None:
            self.chunk_sizes = [8, 4, 2, 1]
        if isinstance(self.chunk_sizes, tuple):
            self.chunk_sizes = list(self.chunk_sizes)
        if not isinstance(self.chunk_sizes, list) or len(self.chunk_sizes) == 0:
            raise ValueError(
                f"SpiralFormerConfig.chunk_sizes must be a non-empty list of integers >= 1, got {self.chunk_sizes!r}"
            )
        for g in self.chunk_sizes:
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise ValueError(
                    f"SpiralFormerConfig.chunk_sizes must contain integers >= 1 only, got {self.chunk_sizes!r}"
                )
        if any(a < b for a, b in itertools.pairwise(self.chunk_sizes)):
            raise ValueError(
                "SpiralFormerConfig.chunk_sizes must run coarse → fine (non-increasing, e.g. [8, 4, 2, 1]), "
                f"got {self.chunk_sizes!r}"
            )

        counts = (self.num_pre_layers, self.num_loop_layers, self.num_post_layers)
        if all(c is None for c in counts) and isinstance(self.num_hidden_layers, int):
            n = self.num_hidden_layers
            self.num_pre_layers = self.num_post_layers = n // 4
            self.num_loop_layers = n - 2 * (n // 4)
        elif any(c is None for c in counts):
            raise ValueError(
                "SpiralFormerConfig.num_pre_layers, num_loop_layers and num_post_layers must be given together "
                f"(or all left None), got {counts}"
            )
        check_int_field(self, "num_pre_layers", 0)
        check_int_field(self, "num_loop_layers", 1)
        check_int_field(self, "num_post_layers", 0)
        if self.num_pre_layers + self.num_post_layers < 1:
            raise ValueError(
                "SpiralFormerConfig.num_pre_layers + num_post_layers must be >= 1: an unshared layer's cache slot "
                "carries the token count that generate() reads"
            )
        total = self.num_pre_layers + self.num_loop_layers + self.num_post_layers
        if total != self.num_hidden_layers:
            raise ValueError(
                f"SpiralFormerConfig.num_hidden_layers must equal num_pre_layers + num_loop_layers + num_post_layers "
                f"= {total}, got {self.num_hidden_layers}"
            )

        check_choice_fields(self)
        if self.mesh_slots is None:
            self.mesh_slots = len(self.chunk_sizes) + 3
        check_int_field(self, "mesh_slots", 2)
        for name in ("scale_embeddings", "depth_scaled_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SpiralFormerConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def num_iterations(self) -> int:
        return len(self.chunk_sizes)

    @property
    def num_virtual_layers(self) -> int:
        """Layers of the unrolled graph: N_pre + T·N_loop + N_post (the depth-scaled init's N_compute)."""
        return self.num_pre_layers + self.num_iterations * self.num_loop_layers + self.num_post_layers


DOWNSCALES = literal_choices(SpiralFormerConfig, "downscale")
UPSCALES = literal_choices(SpiralFormerConfig, "upscale")
TOPOLOGIES = literal_choices(SpiralFormerConfig, "topology")
