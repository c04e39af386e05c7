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

__all__ = [
    "AttentionRecord", "ScalingFit", "Step", "Trace", "accuracy_vs_flops", "attention_distance", "attention_entropy",
    "attention_similarity_matrix", "capture_trace", "classify_limiting_behaviour", "classify_limiting_behaviour_trace",
    "colsum_concentration", "cons_at_n", "cross_iteration_mass", "decider_gain_alignment",
    "degenerate_fixed_point_score", "degenerate_fixed_point_score_trace", "dynamic_heads", "fit_scaling_slope",
    "fixed_point_distance", "fixed_point_distance_trace", "forced_depth_loss_change", "interpolate_accuracy",
    "key_marginal_entropy", "local_attention_mass", "loss_change_fractions", "matrix_entropy", "mixing_score",
    "residual_norm", "residual_similarity_matrix", "sink_rate", "sink_score", "successive_difference",
    "successive_difference_trace",
]
