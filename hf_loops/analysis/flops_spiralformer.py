"""FLOPs and KV-memory accounting for SpiralFormer (spec: spiralformer.md §9).

Convention: forward matmul FLOPs, a multiply-add counts 2. Attention scores + weighted sum cost 4·c·n²·d_q with
c = 1 (full matrix) or c = ½ (causal-aware); every function takes `causal_factor` and says which it uses. Training ≈
3 × forward. Latent counts use the exact closed-chunk count L_t = ⌊(L + ω_t)/g_t⌋ unless `exact_latents=False`, in
which case L_t = r_t·L (the paper's idealisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SpiralShape:
    """The sizes the formulas need, read off a SpiralFormer (or Qwen3) config."""

    hidden: int
    query_width: int
    kv_width: int
    ffn: int
    vocab: int
    num_pre: int
    num_loop: int
    num_post: int
    chunk_sizes: tuple[int, ...]
    topology: str = "mesh"
    mesh_slots: int = 7
    downscale: str = "self_aggregation"
    upscale: str = "output_dependent"
    chunk_offset: str = "half"
    head_dim: int = 64
    num_kv_heads: int = 1

    @classmethod
    def from_config(cls, config) -> "SpiralShape":
        d = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        chunk_sizes = tuple(getattr(config, "chunk_sizes", None) or (1,))
        return cls(
            hidden=d,
            query_width=config.num_attention_heads * head_dim,
            kv_width=kv_heads * head_dim,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            num_pre=getattr(config, "num_pre_layers", 0) or 0,
            num_loop=getattr(config, "num_loop_layers", config.num_hidden_layers),
            num_post=getattr(config, "num_post_layers", 0) or 0,
            chunk_sizes=chunk_sizes,
            topology=getattr(config, "topology", "anchor"),
            mesh_slots=getattr(config, "mesh_slots", None) or len(chunk_sizes) + 3,
            downscale=getattr(config, "downscale", "mean"),
            upscale=getattr(config, "upscale", "uniform"),
            chunk_offset=getattr(config, "chunk_offset", "half"),
            head_dim=head_dim,
            num_kv_heads=kv_heads,
        )

    def omega(self, g: int) -> int:
        return g // 2 if self.chunk_offset == "half" else 0


def resolution_factors(chunk_sizes: Sequence[int]) -> tuple[float, float]:
    """(Σ_t r_t, Σ_t r_t²) with r_t = 1/g_t: the core's linear and attention cost in full-resolution passes."""
    return sum(1.0 / g for g in chunk_sizes), sum(1.0 / g**2 for g in chunk_sizes)


def latent_count(n: int, g: int, omega: int) -> int:
    """Closed chunks after n tokens: L_t = ⌊(n + ω)/g⌋ (spec §4.1, D-11)."""
    return (n + omega) // g


def layer_flops_mha(n: float, d: int, d_ff: int | None = None, causal_factor: float = 1.0) -> float:
    """MHA + 2-matrix MLP layer on n positions: 2n(4d² + 2·d·d_ff) + 4c·n²·d (d_ff = 4d → ≈ 24d²n + 4c·d·n²)."""
    d_ff = 4 * d if d_ff is None else d_ff
    return 2 * n * (4 * d * d + 2 * d * d_ff) + 4 * causal_factor * n * n * d


def layer_flops(n: float, shape: SpiralShape, causal_factor: float = 1.0) -> float:
    """Qwen3 layer (GQA, SwiGLU): 2n(2·d·d_q + 2·d·d_kv + 3·d·d_ff) + 4c·n²·d_q."""
    d, dq, dkv, dff = shape.hidden, shape.query_width, shape.kv_width, shape.ffn
    return 2 * n * (2 * d * dq + 2 * d * dkv + 3 * d * dff) + 4 * causal_factor * n * n * dq


def iteration_flops(
    shape: SpiralShape, t: int, L: int, causal_factor: float = 1.0, exact_latents: bool = True
) -> float:
    """F_iter(t) = N_loop·F_layer(L_t) + F_down + F_up + F_topo (spec §9)."""
    g, d = shape.chunk_sizes[t], shape.hidden
    n_t = latent_count(L, g, shape.omega(g)) if exact_latents else L / g
    core = shape.num_loop * layer_flops(n_t, shape, causal_factor)
    down = 4 * d * L if (shape.downscale == "self_aggregation" and g > 1) else d * L
    up = (2 * d * g * n_t + 2 * d * L) if (shape.upscale == "output_dependent" and g > 1) else d * L
    topo = 8 * shape.mesh_slots * d * L if shape.topology == "mesh" else d * L
    return core + down + up + topo


def forward_flops(shape: SpiralShape, L: int, causal_factor: float = 1.0, exact_latents: bool = True) -> float:
    """Whole-model prefill FLOPs for L tokens: unshared layers + Σ_t F_iter(t) + MeSH transitional + LM head."""
    d = shape.hidden
    total = (shape.num_pre + shape.num_post) * layer_flops(L, shape, causal_factor)
    total += sum(iteration_flops(shape, t, L, causal_factor, exact_latents) for t in range(len(shape.chunk_sizes)))
    if shape.topology == "mesh":
        total += 8 * shape.mesh_slots * d * L
    return total + 2 * d * shape.vocab * L


def looped_forward_flops(shape: SpiralShape, L: int, causal_factor: float = 1.0) -> float:
    """The same model with every iteration at full resolution (LoopedFormer with T iterations) for comparison."""
    from dataclasses import replace

    return forward_flops(replace(shape, chunk_sizes=(1,) * len(shape.chunk_sizes)), L, causal_factor)


def decode_core_flops_per_token(shape: SpiralShape, n: int) -> float:
    """Amortised core cost per decoded token at context n:
    Σ_t (1/g_t)·N_loop·[2(2·d·d_q + 2·d·d_kv + 3·d·d_ff) + 4·d_q·n/g_t]."""
    d, dq, dkv, dff = shape.hidden, shape.query_width, shape.kv_width, shape.ffn
    per_pos = 2 * (2 * d * dq + 2 * d * dkv + 3 * d * dff)
    return sum((1.0 / g) * shape.num_loop * (per_pos + 4 * dq * n / g) for g in shape.chunk_sizes)


def kv_cache_bytes(shape: SpiralShape, n: int, bytes_per_element: int = 2) -> int:
    """KV memory per sample after n tokens: 2·n_kv·d_head·bytes·[(N_pre + N_post)·n + N_loop·Σ_t ⌊(n + ω_t)/g_t⌋].

    Counts the K/V slots only (the per-iteration decode state — accumulator, last latent, column validity — is
    O(T·d) per sample and is not included).
    """
    latents = sum(latent_count(n, g, shape.omega(g)) for g in shape.chunk_sizes)
    positions = (shape.num_pre + shape.num_post) * n + shape.num_loop * latents
    return 2 * shape.num_kv_heads * shape.head_dim * bytes_per_element * positions


def extra_parameters(hidden: int, chunk_sizes: Sequence[int], mesh_slots: int | None, topology: str = "mesh") -> int:
    """Parameters beyond the Qwen3 layers: Σ_{g_t>1}[d + (d+1)·g_t] + 2(T+1)(d+1)·B (scorers, allocators, routers)."""
    T = len(chunk_sizes)
    scal = sum(hidden + (hidden + 1) * g for g in chunk_sizes if g > 1)
    return scal + (mesh_router_parameters(hidden, T, mesh_slots) if topology == "mesh" else 0)


def mesh_router_parameters(hidden: int, num_iterations: int, mesh_slots: int | None = None) -> int:
    """(T + 1) router pairs of Linear(d, B, bias=True): 2·(T+1)·B·(d+1)."""
    B = num_iterations + 3 if mesh_slots is None else mesh_slots
    return 2 * (num_iterations + 1) * B * (hidden + 1)


def mesh_buffer_bytes(mesh_slots: int, L: int, hidden: int, bytes_per_element: int = 2) -> int:
    """Training memory of one live MeSH buffer per sample: B·L·d elements."""
    return mesh_slots * L * hidden * bytes_per_element
