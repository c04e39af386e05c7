"""TaH2 configuration: Qwen3 plus the loop knobs (docs/tah2.md, "Configuration").

A `TaH2Config` is a `Qwen3Config` with a new `model_type`, so a Qwen3 checkpoint's weights keep their names and a
conversion is a key-preserving load plus fresh updater/decider modules.
"""

from __future__ import annotations

from typing import Literal

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .loop_utils import check_choice_fields, check_int_field, check_loop_knobs, literal_choices, validated_at_load

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
    # Ouro Stage II: the same, plus a linear exit gate trained on a frozen backbone; Q-exit, exited tokens' K/V copied.
    "ouro-stage2": {"iteration_attention": "same_iter", "updater": "hidden", "decider": "exit_gate", "mixture": "final",
                    "exit_kv_fill": "copy_last"},
    # Huginn-style: prelude once, core layers looped M times with the Eq. 12 adapter, coda once, LM head once. The
    # core defaults to the paper's layers 8–21 of 28 (1-based), scaled to the model's depth.
    "huginn": {"max_iterations": 3, "core_adapter": "huginn", "iteration_attention": "same_iter", "decider": "always",
               "mixture": "final", "updater": "identity"},
}


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
        decider (`str`, "learned"): "learned" (Eq. 10), "always" (run every depth: TaH2-fixed), "never" (depth 1),
            "exit_gate" (Ouro Stage II: a linear exit gate λ = σ(wᵀ sg[h]) on each depth, Q-exit at inference: stop at
            the first depth whose cumulative exit probability reaches `exit_threshold`).
        decider_intermediate_size (`int`, hidden_size): SwiGLU width of the learned decider.
        decider_topk (`int`, hidden_size): number of top next-token probabilities the decider reads (zero-padded
            when the vocabulary is smaller).
        loop_span (`list[int]`, None): Huginn-style baseline: [start, end), 0-based, of the core layers looped M
            times between a prelude (layers before start, once) and a coda (layers from end, once). None = TaH2's
            whole-backbone loop, or with `core_adapter="huginn"` the paper's span (layers 8–21 of 28, 1-based) scaled
            to `num_hidden_layers`: [L·7//28, L·21//28).
        core_adapter (`str`, None): "huginn": the core input after iteration m is u = a ⊙ r(m) + v ⊙ W_in z
            (Eq. 12, z = prelude output, v = softplus(b_in), a = exp(−v ⊙ exp(b_ret))); None: u = r(m).
        exit_kv_fill (`str`, None): "copy_last" (Ouro-style decode): a token that exits at depth e exposes its
            depth-e keys/values in every deeper stream.
    """

    model_type = "tah2"

    max_iterations: int = 2
    exit_threshold: float = 0.5
    iteration_attention: Literal["duo", "causal", "same_iter"] = "duo"
    decision_mode: Literal["threshold", "sample"] = "threshold"
    mixture: Literal["stop_prob", "even", "final"] = "stop_prob"
    updater: Literal["learned", "identity", "hidden", "topk_embedding"] = "learned"
    updater_intermediate_size: int | None = None
    updater_norm_pre_mlp: bool = True
    updater_norm_out: bool = True
    updater_topk: int = 100
    decider: Literal["learned", "always", "never", "exit_gate"] = "learned"
    decider_intermediate_size: int | None = None
    decider_topk: int | None = None
    loop_span: list[int] | None = None
    core_adapter: Literal["huginn"] | None = None
    exit_kv_fill: Literal["copy_last"] | None = None

    def __post_init__(self, **kwargs):
        if self.updater_intermediate_size is None:
            self.updater_intermediate_size = self.hidden_size
        if self.decider_intermediate_size is None:
            self.decider_intermediate_size = self.hidden_size
        if self.decider_topk is None:
            self.decider_topk = self.hidden_size
        self.check_loop_fields()
        self.exit_threshold = float(self.exit_threshold)
        super().__post_init__(**kwargs)
        if self.use_sliding_window:
            raise ValueError(
                "TaH2Config.use_sliding_window must be False: cross-iteration (duo) masks are built for full attention"
            )

    def check_loop_fields(self) -> None:
        """Validate every TaH2 field (ValueError naming the field); also run on values given at load time."""
        check_loop_knobs(self.max_iterations, self.exit_threshold, owner="TaH2Config.")
        check_choice_fields(self)
        for name in ("updater_intermediate_size", "decider_intermediate_size", "decider_topk", "updater_topk"):
            check_int_field(self, name, 1)
        for name in ("updater_norm_pre_mlp", "updater_norm_out"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TaH2Config.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_loop_span()
        if self.decider == "exit_gate" and self.mixture != "final":
            raise ValueError("TaH2Config.decider='exit_gate' (Ouro Stage II) outputs each token's exit depth: it needs "
                             f"mixture='final', got {self.mixture!r}")
        if self.exit_kv_fill is not None and (self.decider != "exit_gate" or self.iteration_attention != "same_iter"):
            raise ValueError("TaH2Config.exit_kv_fill='copy_last' is the Ouro-style decode rule: it needs "
                             "decider='exit_gate' and iteration_attention='same_iter'")

    def _check_loop_span(self) -> None:
        """Huginn-style prelude / core / coda: `loop_span` = [start, end), 0-based, of the looped core layers."""
        if self.loop_span is None:
            if self.core_adapter is None:
                return
            # The paper's span, layers 8–21 of 28 (1-based): the middle half, scaled to this depth.
            L = self.num_hidden_layers
            self.loop_span = [L * 7 // 28, max(L * 21 // 28, L * 7 // 28 + 1)]
        span = self.loop_span
        L = self.num_hidden_layers
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in span) or not 0 <= span[0] < span[1] <= L):
            raise ValueError(f"TaH2Config.loop_span must be [start, end) with 0 <= start < end <= num_hidden_layers "
                             f"({L}), got {span!r}")
        self.loop_span = [int(span[0]), int(span[1])]
        wanted = {"decider": "always", "iteration_attention": "same_iter", "mixture": "final"}
        wrong = {k: getattr(self, k) for k, v in wanted.items() if getattr(self, k) != v}
        if wrong:
            raise ValueError(f"TaH2Config.loop_span (Huginn-style) runs every core iteration with same-iteration "
                             f"attention and reads the last one: it needs {wanted}, got {wrong}")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`from_pretrained(..., exit_threshold=2.0)` sets load-time values after `__init__`: validate them too."""
        return validated_at_load(super().from_dict(config_dict, **kwargs))


ITERATION_ATTENTION_MODES = literal_choices(TaH2Config, "iteration_attention")
MIXTURES = literal_choices(TaH2Config, "mixture")
UPDATERS = literal_choices(TaH2Config, "updater")
DECIDERS = literal_choices(TaH2Config, "decider")
DECISION_MODES = literal_choices(TaH2Config, "decision_mode")
