"""Analysis wing: probes, FLOPs accounting, plots."""

from .attention_metrics import (
    attention_distance,
    attention_entropy,
    attention_similarity_matrix,
    colsum_concentration,
    cross_iteration_mass,
    dynamic_heads,
    key_marginal_entropy,
    local_attention_mass,
    mixing_score,
    sink_rate,
    sink_score,
)
from .residual_metrics import (
    classify_limiting_behaviour,
    classify_limiting_behaviour_trace,
    degenerate_fixed_point_score,
    degenerate_fixed_point_score_trace,
    fixed_point_distance,
    fixed_point_distance_trace,
    fixed_point_separation_trace,
    matrix_entropy,
    residual_norm,
    residual_similarity_matrix,
    successive_difference,
    successive_difference_trace,
)
from .slopes import (
    ScalingFit,
    accuracy_vs_flops,
    cons_at_n,
    fit_scaling_slope,
    interpolate_accuracy,
)
from .tah2_depth import decider_gain_alignment, forced_depth_loss_change, loss_change_fractions
from .trace import AttentionRecord, Step, Trace, capture_trace


def flops(model_or_config, prompt_streams, decode_depths, max_iterations=None) -> float:
    """Decode FLOPs of `len(decode_depths)` tokens (per-token depths `decode_depths`) after a prompt whose positions
    kept `prompt_streams` KV streams, for any hf_loops architecture: dispatched through its registry entry's FLOPs
    module (`hf_loops.core.flops_tah2`, `flops_spiralformer`, `flops_sgt`); plain Qwen3 gets the Standard formula."""
    from ..conversion.registry import ARCHITECTURES
    from ..core.flops_tah2 import decode_flops_standard

    config = getattr(model_or_config, "config", model_or_config)
    spec = ARCHITECTURES.get(getattr(config, "model_type", ""))
    if spec is None:
        return float(decode_flops_standard(config, len(prompt_streams), len(decode_depths)))
    return float(spec.flops.decode_flops(config, list(prompt_streams), list(decode_depths), max_iterations))

__all__ = [
    "AttentionRecord", "ScalingFit", "flops", "Step", "Trace", "accuracy_vs_flops", "attention_distance", "attention_entropy",
    "attention_similarity_matrix", "capture_trace", "classify_limiting_behaviour", "classify_limiting_behaviour_trace",
    "colsum_concentration", "cons_at_n", "cross_iteration_mass", "decider_gain_alignment",
    "degenerate_fixed_point_score", "degenerate_fixed_point_score_trace", "dynamic_heads", "fit_scaling_slope",
    "fixed_point_distance", "fixed_point_distance_trace", "fixed_point_separation_trace", "forced_depth_loss_change", "interpolate_accuracy",
    "key_marginal_entropy", "local_attention_mass", "loss_change_fractions", "matrix_entropy", "mixing_score",
    "residual_norm", "residual_similarity_matrix", "sink_rate", "sink_score", "successive_difference",
    "successive_difference_trace",
]
