"""FLOPs and KV-memory accounting for SpiralFormer (docs/spiralformer.md).

Convention: forward matmul FLOPs, a multiply-add counts 2. Attention scores + weighted sum cost 4·c·n²·d_q with
c = 1 (full matrix) or c = ½ (causal-aware); every function takes `causal_factor` and says which it uses. Training ≈
3 × forward. Latent counts use the exact closed-chunk count L_t = ⌊(L + ω_t)/g_t⌋ unless `exact_latents=False`, in
which case L_t = r_t·L (the paper's idealisation).

The MLP is SwiGLU (3 matrices, Qwen3) or, with `mlp="gelu"`, the 2-matrix GELU MLP of the paper's Pythia/GPT-NeoX
blocks. `softmax_flops` adds that many FLOPs per attention score per head (Chinchilla's count is 3; 0 by default).

Comparisons: `compare_to_looped` puts a schedule beside the paper's LoopedFormer baseline (the same split with
`chunk_sizes = [1, 1]`, Table 1) and beside T full-resolution passes. `pythia_shape` / `TABLE1` give the paper's
Table 1 models (Pythia sizes, sequence 4096, MeSH); `table1_ratios()` reproduces its SpiralFormer-B / LoopedFormer
FLOPs ratios 0.897 / 0.895 / 0.926 / 0.918 within 1e-3 (see `TABLE1_ACCOUNTING` for the convention that does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

MLP_MATRICES = {"swiglu": 3, "gelu": 2}  # d×d_ff matrices per MLP: gate/up/down (Qwen3) or up/down (GPT-NeoX)


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
    mlp: str = "swiglu"
    softmax_flops: float = 0.0

    def __post_init__(self):
        if self.mlp not in MLP_MATRICES:
            raise ValueError(f"SpiralShape.mlp must be one of {sorted(MLP_MATRICES)}, got {self.mlp!r}")

    @property
    def num_heads(self) -> int:
        return self.query_width // self.head_dim

    @classmethod
    def from_config(cls, config) -> SpiralShape:
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
    """Closed chunks after n tokens: L_t = ⌊(n + ω)/g⌋ (ω virtual members pad chunk 0)."""
    return (n + omega) // g


def layer_flops_mha(n: float, d: int, d_ff: int | None = None, causal_factor: float = 1.0) -> float:
    """MHA + 2-matrix MLP layer on n positions: 2n(4d² + 2·d·d_ff) + 4c·n²·d (d_ff = 4d → ≈ 24d²n + 4c·d·n²)."""
    d_ff = 4 * d if d_ff is None else d_ff
    return 2 * n * (4 * d * d + 2 * d * d_ff) + 4 * causal_factor * n * n * d


def layer_flops(n: float, shape: SpiralShape, causal_factor: float = 1.0) -> float:
    """Qwen3 layer (GQA, SwiGLU): 2n(2·d·d_q + 2·d·d_kv + 3·d·d_ff) + 4c·n²·d_q; a GELU MLP has 2·d·d_ff instead of
    3·d·d_ff (MHA with d_q = d_kv = d and d_ff = 4d: `layer_flops_mha`); plus c·s·H·n² for `softmax_flops` s."""
    d, dq, dkv, dff = shape.hidden, shape.query_width, shape.kv_width, shape.ffn
    mlp = MLP_MATRICES[shape.mlp] * d * dff
    softmax = causal_factor * shape.softmax_flops * shape.num_heads * n * n
    return 2 * n * (2 * d * dq + 2 * d * dkv + mlp) + 4 * causal_factor * n * n * dq + softmax


def iteration_flops(
    shape: SpiralShape, t: int, L: int, causal_factor: float = 1.0, exact_latents: bool = True
) -> float:
    """F_iter(t) = N_loop·F_layer(L_t) + F_down + F_up + F_topo."""
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


def looped_forward_flops(shape: SpiralShape, L: int, causal_factor: float = 1.0, iterations: int | None = None) -> float:
    """The same split with every iteration at full resolution: a LoopedFormer with `iterations` passes (default T,
    the spiral's own count; the paper's baseline is `iterations=2`, see `looped_baseline_flops`). A MeSH baseline
    gets its own B = iterations + 3 slots."""
    T = len(shape.chunk_sizes) if iterations is None else iterations
    if T < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations!r}")
    slots = T + 3 if shape.topology == "mesh" else shape.mesh_slots
    return forward_flops(replace(shape, chunk_sizes=(1,) * T, mesh_slots=slots), L, causal_factor)


def looped_baseline_flops(shape: SpiralShape, L: int, causal_factor: float = 1.0) -> float:
    """The paper's LoopedFormer baseline of Table 1: the same split, `chunk_sizes = [1, 1]` (two full passes)."""
    return looped_forward_flops(shape, L, causal_factor, iterations=2)


def compare_to_looped(shape: SpiralShape, L: int, causal_factor: float = 1.0, exact_latents: bool = True) -> dict:
    """Prefill FLOPs of `shape` beside the paper's {1,1} LoopedFormer and beside T full-resolution passes."""
    spiral = forward_flops(shape, L, causal_factor, exact_latents)
    looped_11 = looped_baseline_flops(shape, L, causal_factor)
    looped_t = looped_forward_flops(shape, L, causal_factor)
    return {"flops": spiral, "looped_1_1_flops": looped_11, "ratio_vs_looped_1_1": spiral / looped_11,
            "looped_T_flops": looped_t, "ratio_vs_looped_T": spiral / looped_t}


# --- the paper's Table 1: GPT-NeoX/Pythia blocks (MHA, GELU MLP 4d), vocabulary 50,304, L = 4096 --------
PYTHIA_SHAPES = {  # size: (hidden, heads, layers of the Pythia baseline)
    "160M": (768, 12, 12), "410M": (1024, 16, 24), "1B": (2048, 8, 16), "1.4B": (2048, 16, 24),
}
PYTHIA_VOCAB = 50_304
TABLE1_SEQ_LEN = 4096
# N_pre + N_loop × {...} + N_post of SpiralFormer-B† (LoopedFormer† = the same split with {1, 1}) and SpiralFormer-L†.
TABLE1 = {
    "160M": {"B": (2, 4, 2), "L": (4, 4, 4)},
    "410M": {"B": (4, 8, 4), "L": (8, 8, 8)},
    "1B": {"B": (3, 5, 3), "L": (5, 6, 5)},
    "1.4B": {"B": (4, 8, 4), "L": (8, 8, 8)},
}
TABLE1_PAPER_FLOPS = {  # 10^12 prefill FLOPs for 4096 tokens: (Pythia, LoopedFormer†, SpiralFormer-B†, SpiralFormer-L†)
    "160M": (1.65, 1.65, 1.48, 1.49), "410M": (4.59, 4.59, 4.11, 4.16),
    "1B": (9.67, 9.67, 8.95, 8.96), "1.4B": (14.08, 14.08, 12.92, 13.13),
}
# The convention that reproduces Table 1: full attention matrix (c = 1), GELU MLP, Chinchilla's 3 FLOPs per softmax
# score, MeSH routers included, LM head counted, input embedding lookup not counted.
TABLE1_ACCOUNTING = {"mlp": "gelu", "softmax_flops": 3.0, "causal_factor": 1.0}


def pythia_shape(size: str, chunk_sizes: Sequence[int] = (8, 4, 2, 1), split: tuple[int, int, int] | None = None,
                 topology: str = "mesh", mlp: str = TABLE1_ACCOUNTING["mlp"],
                 softmax_flops: float = TABLE1_ACCOUNTING["softmax_flops"]) -> SpiralShape:
    """A SpiralShape with Pythia-`size` blocks (MHA, d_ff = 4d); `split` defaults to Table 1's SpiralFormer-B split."""
    if size not in PYTHIA_SHAPES:
        raise ValueError(f"size must be one of {list(PYTHIA_SHAPES)}, got {size!r}")
    d, heads, _ = PYTHIA_SHAPES[size]
    pre, loop, post = TABLE1[size]["B"] if split is None else split
    return SpiralShape(hidden=d, query_width=d, kv_width=d, ffn=4 * d, vocab=PYTHIA_VOCAB, num_pre=pre,
                       num_loop=loop, num_post=post, chunk_sizes=tuple(chunk_sizes), topology=topology,
                       mesh_slots=len(chunk_sizes) + 3, head_dim=d // heads, num_kv_heads=heads, mlp=mlp,
                       softmax_flops=softmax_flops)


def table1_flops(size: str) -> dict:
    """Our prefill FLOPs (10^12, L = 4096) for Table 1's models of one size: Pythia, LoopedFormer†, SpiralFormer-B†
    and SpiralFormer-L†."""
    c = TABLE1_ACCOUNTING["causal_factor"]
    _, _, layers = PYTHIA_SHAPES[size]
    spiral_b = pythia_shape(size)
    spiral_l = pythia_shape(size, (16, 8, 4, 2), TABLE1[size]["L"])
    baseline = replace(pythia_shape(size, (1,), (0, layers, 0)), topology="anchor")
    # a plain stack: drop the one full-resolution iteration's down/up/topology terms (d·L each)
    baseline_flops = forward_flops(baseline, TABLE1_SEQ_LEN, c) - 3 * TABLE1_SEQ_LEN * baseline.hidden
    return {"pythia": baseline_flops / 1e12, "looped": looped_baseline_flops(spiral_b, TABLE1_SEQ_LEN, c) / 1e12,
            "spiral_b": forward_flops(spiral_b, TABLE1_SEQ_LEN, c) / 1e12,
            "spiral_l": forward_flops(spiral_l, TABLE1_SEQ_LEN, c) / 1e12}


def table1_ratios() -> dict[str, float]:
    """SpiralFormer-B† / LoopedFormer† prefill FLOPs per Table 1 size (paper: 0.897, 0.895, 0.926, 0.918)."""
    return {size: compare_to_looped(pythia_shape(size), TABLE1_SEQ_LEN,
                                    TABLE1_ACCOUNTING["causal_factor"])["ratio_vs_looped_1_1"] for size in TABLE1}


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


def decode_flops(config, prompt_streams, decode_depths, max_iterations=None) -> float:
    """Decode FLOPs of SpiralFormer for `len(decode_depths)` tokens after a prompt of `len(prompt_streams)` tokens:
    pre/post layers per token plus the core's amortised per-token cost at each context length, and the LM head."""
    s = SpiralShape.from_config(config)
    d = s.hidden
    per_layer = 4 * d * (s.query_width + s.kv_width) + 6 * d * s.ffn
    P, total = len(prompt_streams), 0.0
    for t in range(1, len(decode_depths) + 1):
        n = P + t
        total += (s.num_pre + s.num_post) * (per_layer + 4 * s.query_width * n)
        total += decode_core_flops_per_token(s, n) + 2 * d * s.vocab
    return total
