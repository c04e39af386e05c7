"""TaH2 configuration: Qwen3 plus the loop knobs (spec: shared/specs/tah2.md §6).

A `TaH2Config` is a `Qwen3Config` with a new `model_type`, so a Qwen3 checkpoint's weights keep their names and a
conversion is a key-preserving load plus fresh updater/decider modules.
"""

from __future__ import annotations

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

ITERATION_ATTENTION_MODES = ("duo", "causal", "same_iter")
MIXTURES = ("stop_prob", "even", "final")
UPDATERS = ("learned", "identity", "hidden", "topk_embedding")
DECIDERS = ("learned", "always", "never")
DECISION_MODES = ("threshold", "sample")

# Baselines of the paper expressed as configurations (README "Baselines").
TAH2_PRESETS: dict[str, dict] = {
    # TaH2: adaptive depth, duo-causal attention, learned updater and decider, stopping-weighted mixture.
    "tah2": {},
    # Standard: the plain Qwen3 model (one pass); logits equal Qwen3ForCausalLM's.
    "standard": {"max_iterations": 1, "decider": "never", "updater": "identity"},
    # TaH2-fixed: every token runs all M depths, earlier tokens expose only depth 1, even mixture.
    "tah2-fixed": {"iteration_attention": "causal", "decider": "always", "mixture": "even"},
    # Ouro-style: the hidden state is passed straight on, one KV stream per iteration, no decider, even mixture.
    "ouro": {"iteration_attention": "same_iter", "updater": "hidden", "decider": "always", "mixture": "even"},
}


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"TaH2Config.{name} must be one of {list(allowed)}, got {value!r}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TaH2Config.{name} must be an integer >= 1, got {value!r}")


class TaH2Config(Qwen3Config):
    r"""
    Configuration of an adaptive looped Qwen3 (TaH2).

    Args (in addition to `Qwen3Config`'s):
        max_iterations (`int`, 2): maximum depth M (number of passes through the whole backbone), >= 1.
        exit_threshold (`float`, 0.5): τ; a token continues after depth m iff its decider probability g > τ. In (0, 1).
        iteration_attention (`str`, "duo"): visibility across iterations: "duo" (a query at depth d sees every
            earlier token's states of depth <= d), "causal" (earlier tokens expose only depth 1), "same_iter" (only
            states of the same depth).
        decision_mode (`str`, "threshold"): "threshold" (g > τ, deterministic) or "sample" (Bernoulli(g)).
        mixture (`str`, "stop_prob"): output distribution: "stop_prob" (stopping-weighted mixture, Eq. 4), "even"
            (uniform over executed depths), "final" (the last executed depth only).
        updater (`str`, "learned"): next-iteration input: "learned" (Eq. 9), "identity" (the token embedding),
            "hidden" (the last hidden state, Ouro-style), "topk_embedding" (top-k probability-weighted embeddings,
            TaH v1).
        updater_intermediate_size (`int`, hidden_size): SwiGLU width of the learned updater.
        updater_norm_pre_mlp, updater_norm_out (`bool`, True): the updater's optional RMSNorms.
        updater_topk (`int`, 100): k of the "topk_embedding" updater.
        decider (`str`, "learned"): "learned" (Eq. 10), "always" (run every depth: TaH2-fixed), "never" (depth 1).
        decider_intermediate_size (`int`, hidden_size): SwiGLU width of the learned decider.
        decider_topk (`int`, hidden_size): number of top next-token probabilities the decider reads (zero-padded
            when the vocabulary is smaller).
    """

    model_type = "tah2"

    max_iterations: int = 2
    exit_threshold: float = 0.5
    iteration_attention: str = "duo"
    decision_mode: str = "threshold"
    mixture: str = "stop_prob"
    updater: str = "learned"
    updater_intermediate_size: int | None = None
    updater_norm_pre_mlp: bool = True
    updater_norm_out: bool = True
    updater_topk: int = 100
    decider: str = "learned"
    decider_intermediate_size: int | None = None
    decider_topk: int | None = None

    def __post_init__(self, **kwargs):
        _check_positive_int("max_iterations", self.max_iterations)
        if isinstance(self.exit_threshold, bool) or not isinstance(self.exit_threshold, (int, float)):
            raise ValueError(f"TaH2Config.exit_threshold must be a float in (0, 1), got {self.exit_threshold!r}")
        if not 0.0 < float(self.exit_threshold) < 1.0:
            raise ValueError(f"TaH2Config.exit_threshold must be in the open interval (0, 1), got {self.exit_threshold}")
        self.exit_threshold = float(self.exit_threshold)
        _check_choice("iteration_attention", self.iteration_attention, ITERATION_ATTENTION_MODES)
        _check_choice("decision_mode", self.decision_mode, DECISION_MODES)
        _check_choice("mixture", self.mixture, MIXTURES)
        _check_choice("updater", self.updater, UPDATERS)
        _check_choice("decider", self.decider, DECIDERS)
        if self.updater_intermediate_size is None:
            self.updater_intermediate_size = self.hidden_size
        if self.decider_intermediate_size is None:
            self.decider_intermediate_size = self.hidden_size
        if self.decider_topk is None:
            self.decider_topk = self.hidden_size
        _check_positive_int("updater_intermediate_size", self.updater_intermediate_size)
        _check_positive_int("decider_intermediate_size", self.decider_intermediate_size)
        _check_positive_int("decider_topk", self.decider_topk)
        _check_positive_int("updater_topk", self.updater_topk)
        for name in ("updater_norm_pre_mlp", "updater_norm_out"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TaH2Config.{name} must be a bool, got {getattr(self, name)!r}")
        super().__post_init__(**kwargs)
        if self.use_sliding_window:
            raise ValueError(
                "TaH2Config.use_sliding_window must be False: cross-iteration (duo) masks are built for full attention"
            )
