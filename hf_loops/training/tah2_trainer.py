"""TRL SFT trainer for TaH2 with lookahead depth supervision (docs/tah2.md, "Post-training TaH2").

`TaH2SFTTrainer` overrides one seam, `compute_loss`: TRL's default path runs the backbone through a fused LM head and
would skip the iteration loop. Per batch:
  1. main forward along the decider's own routes (gradients), recording per-depth losses and decider logits;
  2. the no-gradient lookahead: every token executed at depth m runs depth m+1 under `duo_posterior` visibility;
  3. gains, coverage cutoff (pooled over data-parallel ranks), continue labels, cost-sensitive weights, class balance;
  4. loss = mixture NLL + α_D · weighted BCE, both normalised by the global number of supervised tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import SFTConfig, SFTTrainer

from ..core.numbers import check_float, check_int
from ..modeling.modeling_tah2 import shift_targets
from .checkpoints import AtomicCheckpointsMixin
from .fingerprints import register_tokenizer_fingerprint
from .tah2_labels import compute_depth_labels, decider_bce_sum, ouro_gate_loss_sum


@dataclass
class TaH2SFTConfig(SFTConfig):
    """`SFTConfig` plus the knobs of lookahead depth supervision (paper defaults)."""

    coverage: float = field(default=0.99, metadata={"help": "ρ: fraction of the total positive gain the continue labels cover, in (0, 1]."})
    decider_loss_weight: float = field(default=0.05, metadata={"help": "α_D: weight of the decider BCE, >= 0."})
    cost_min: float = field(default=1e-6, metadata={"help": "Lower clip of the cost-sensitive BCE weights, > 0."})
    cost_max: float = field(default=1.0, metadata={"help": "Upper clip of the cost-sensitive BCE weights, >= cost_min."})
    beta_clamp_min: float | None = field(default=0.02, metadata={"help": "Lower clamp of the class balance β (None: no clamp)."})
    beta_clamp_max: float | None = field(default=50.0, metadata={"help": "Upper clamp of the class balance β (None: no clamp)."})
    bce_margin: float = field(default=0.0, metadata={"help": "Logit margin of the decider BCE, >= 0."})
    lookahead: bool = field(default=True, metadata={"help": "Train the decider with lookahead labels (learned decider, M >= 2, duo/same_iter)."})
    gate_sharpness: float = field(default=50.0, metadata={"help": "Ouro Stage II (decider='exit_gate'): k of the soft gate target σ(k(I − γ)), > 0."})
    gate_margin: float = field(default=0.005, metadata={"help": "Ouro Stage II: γ of the soft gate target, >= 0."})
    base_warmup_steps: int = field(default=0, metadata={"help": "Threshold warm-up: τ ramps linearly from 0 to the model's exit_threshold over this many optimizer steps (0: off)."})

    def __post_init__(self):
        self._check_trainer_numbers()
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")
        if self.decider_loss_weight < 0:
            raise ValueError(f"decider_loss_weight must be >= 0, got {self.decider_loss_weight}")
        if not 0.0 < self.cost_min <= self.cost_max:
            raise ValueError(f"cost_min/cost_max must satisfy 0 < cost_min <= cost_max, got {self.cost_min}, {self.cost_max}")
        if (self.beta_clamp_min is None) != (self.beta_clamp_max is None):
            raise ValueError("beta_clamp_min and beta_clamp_max must both be set or both be None")
        if self.beta_clamp_min is not None and not 0.0 < self.beta_clamp_min <= self.beta_clamp_max:
            raise ValueError(f"beta clamp must satisfy 0 < beta_clamp_min <= beta_clamp_max, got "
                             f"{self.beta_clamp_min}, {self.beta_clamp_max}")
        if self.bce_margin < 0:
            raise ValueError(f"bce_margin must be >= 0, got {self.bce_margin}")
        if not self.gate_sharpness > 0 or self.gate_margin < 0:
            raise ValueError(f"gate_sharpness must be > 0 and gate_margin >= 0, got {self.gate_sharpness}, "
                             f"{self.gate_margin}")
        if self.base_warmup_steps < 0:
            raise ValueError(f"base_warmup_steps must be >= 0, got {self.base_warmup_steps}")
        if self.ddp_find_unused_parameters is None:
            # TaH2's forward reaches every trainable parameter in every step (see `_unused_parameter_anchor`), so DDP's
            # extra graph traversal for unused parameters would find none; either setting is correct.
            self.ddp_find_unused_parameters = False
        super().__post_init__()

    def _check_trainer_numbers(self) -> None:
        """The Trainer's own numbers, which it takes as given: `learning_rate inf` would train to NaN weights and
        exit 0, `num_train_epochs nan` and `gradient_accumulation_steps 0` fail deep inside with Python's words."""
        check_float("learning_rate", self.learning_rate, 0)
        check_float("num_train_epochs", self.num_train_epochs, 0, low_open=True)
        check_float("weight_decay", self.weight_decay, 0)
        check_float("warmup_steps", self.warmup_steps, 0)
        if self.max_grad_norm is not None:
            check_float("max_grad_norm", self.max_grad_norm, 0)
        check_float("adam_epsilon", self.adam_epsilon, 0, low_open=True)
        check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        check_int("per_device_train_batch_size", self.per_device_train_batch_size, 1)

    @property
    def beta_clamp(self):
        return None if self.beta_clamp_min is None else (self.beta_clamp_min, self.beta_clamp_max)


def _unwrap(model):
    """The TaH2ForCausalLM inside DDP/accelerate/PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def uses_lookahead(core, args) -> bool:
    cfg = core.config
    return (
        getattr(args, "lookahead", False)
        and cfg.decider == "learned"
        and cfg.max_iterations >= 2
        and cfg.iteration_attention != "causal"  # no lookahead in causal/fixed mode (no cross-iteration attention to supervise)
    )


def _supervised_targets(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: positions with a target, i.e. a shifted label that is not -100 at a real (non-padding) position —
    the same rule the model applies (a padding position never runs, so it predicts nothing)."""
    supervised = shift_targets(labels) != -100
    if attention_mask is not None and attention_mask.dim() == 2:
        supervised = supervised & attention_mask[:, -labels.shape[1]:].bool()
    return supervised


def tah2_joint_loss(model, inputs, args, num_items_in_batch=None, return_logits: bool = False):
    """(loss, outputs, metrics) of one micro-batch (Eq. 7): mixture NLL + α_D · weighted decider BCE, both divided
    by the supervised-token count N (`num_items_in_batch`, the Trainer's convention, else this batch's count).
    `args` carries the supervision knobs (a `TaH2SFTConfig`). `return_logits` also returns the full mixture
    log-probabilities as `outputs.logits` (evaluation/prediction; not materialised in training).

    `metrics` maps a name to a `(numerator, denominator)` pair of this micro-batch's sums: summed over micro-batches
    and ranks before dividing, a logged value means the same for any accumulation or process count (`ntp_loss` is the
    mean NLL per supervised token, `decider_loss` the weighted BCE per supervised token, rates are per token). δ_cut
    and β are per-batch quantities and come as `(value, 1)`."""
    core = _unwrap(model)
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    tau = inputs.get("exit_threshold")
    tau = core.config.exit_threshold if tau is None else tau
    lookahead = uses_lookahead(core, args)
    exit_gate = core.config.decider == "exit_gate" and core.config.max_iterations >= 2
    outputs = model(**inputs, labels=labels, use_cache=False, return_loop_records=lookahead or exit_gate,
                    return_mixture_logits=return_logits, num_items_in_batch=num_items_in_batch)
    supervised = _supervised_targets(labels, inputs.get("attention_mask"))
    n_local = supervised.sum()
    n = torch.as_tensor(num_items_in_batch if num_items_in_batch is not None else n_local,
                        device=outputs.loss.device).clamp(min=1)
    ntp = outputs.loss
    loss = ntp
    one = torch.ones((), device=ntp.device)
    # ntp * n is this micro-batch's NLL sum whatever N the loss was normalised by.
    metrics = {"ntp_loss": (ntp.detach() * n, n_local)}
    depths = outputs.iter_counts
    metrics["mean_depth"] = (depths[supervised].float().sum(), n_local)
    M = core.config.max_iterations
    for m in range(1, M):  # every rank logs every key (the reductions are collectives)
        ran = depths >= m
        metrics[f"continue_rate@{m}"] = (((depths > m) & ran).sum(), ran.sum())
    if lookahead:
        rec = outputs.loop_records
        look = core.lookahead_logprobs(rec)
        labels_d = compute_depth_labels(
            rec.executed,
            [-lp for lp in rec.token_logprob],
            [-lp for lp in look],
            rec.targets != -100,
            M,
            coverage=args.coverage,
            cost_min=args.cost_min,
            cost_max=args.cost_max,
            beta_clamp=args.beta_clamp,
        )
        bce_sum = decider_bce_sum(rec.decider_logits, labels_d, margin=args.bce_margin).to(ntp.device)
        loss = ntp + args.decider_loss_weight * bce_sum / n
        metrics["decider_loss"] = (bce_sum.detach(), n_local)
        accuracy = decider_accuracy_counts(rec.decider_logits, labels_d, tau, M)  # τ of this step (warm-up)
        for m in range(1, M):
            c, terms = labels_d.continue_labels[m - 1], labels_d.bce_mask[m - 1]
            metrics[f"delta_cut@{m}"] = (torch.tensor(labels_d.delta_cut[m - 1]), one)
            metrics[f"beta@{m}"] = (torch.tensor(labels_d.beta[m - 1]), one)
            metrics[f"label_continue_rate@{m}"] = ((c & terms).sum(), terms.sum())
            metrics[f"decider_acc@{m}"] = accuracy[m]
        outputs.depth_labels = labels_d
    if exit_gate:  # Ouro Stage II (Eq. 11): the gate alone learns, from soft targets; the backbone is frozen
        gate_sum = ouro_gate_loss_sum(outputs.loop_records, args.gate_sharpness, args.gate_margin).to(ntp.device)
        loss = gate_sum / n + 0.0 * ntp
        metrics["gate_loss"] = (gate_sum.detach(), n_local)
    return loss, outputs, metrics


def metric_values(metrics: dict) -> dict:
    """The per-micro-batch value of each `tah2_joint_loss` metric (numerator ÷ denominator; 0 when empty)."""
    return {k: float(num) / float(den) if float(den) > 0 else 0.0 for k, (num, den) in metrics.items()}


def decider_accuracy_counts(decider_logits, depth_labels, exit_threshold: float, M: int) -> dict:
    """{m: (correct, total)} per boundary m = 1..M-1: the decider's decision (continue when its logit exceeds
    logit(τ)) against the lookahead continue label, over the tokens the BCE supervises. A boundary the decider never
    reached counts its labelled tokens as wrong."""
    threshold_logit = torch.logit(torch.tensor(float(exit_threshold)))
    counts = {}
    for m in range(1, M):
        c, terms = depth_labels.continue_labels[m - 1], depth_labels.bce_mask[m - 1]
        if m - 1 < len(decider_logits):
            pred = decider_logits[m - 1].detach() > threshold_logit.to(decider_logits[m - 1].device)
            counts[m] = (((pred == c) & terms).sum(), terms.sum())
        else:
            counts[m] = (torch.zeros(()), terms.sum())
    return counts


def label_settings(lookahead: bool = True):
    """The lookahead-label settings of a default `TaH2SFTConfig` (ρ, cost clips, β clamp, margin, α_D), for
    measuring the decider outside training (`hf-loops eval`) with the labels training would use."""
    import argparse
    import dataclasses

    d = {f.name: f.default for f in dataclasses.fields(TaH2SFTConfig)}
    clamp = None if d["beta_clamp_min"] is None else (d["beta_clamp_min"], d["beta_clamp_max"])
    return argparse.Namespace(lookahead=lookahead, coverage=d["coverage"], cost_min=d["cost_min"],
                              cost_max=d["cost_max"], beta_clamp=clamp, bce_margin=d["bce_margin"],
                              decider_loss_weight=d["decider_loss_weight"])


class TaH2SFTTrainer(AtomicCheckpointsMixin, SFTTrainer):
    """`SFTTrainer` whose loss is TaH2's joint objective (Eq. 7) with lookahead labels."""

    def __init__(self, *args, **kwargs):
        # Before SFTTrainer prepares the datasets: each of its `map` calls fingerprints the tokenizer (fingerprints.py).
        register_tokenizer_fingerprint(kwargs.get("processing_class", args[5] if len(args) > 5 else None))
        super().__init__(*args, **kwargs)
        core = _unwrap(self.model)
        if getattr(core.config, "decider", None) == "exit_gate":
            # Ouro Stage II trains the exit gate on a frozen backbone.
            for name, p in core.named_parameters():
                p.requires_grad_(name.startswith("decider."))

    def get_decay_parameter_names(self, model) -> list[str]:
        # The official recipe decays every parameter except nn.LayerNorm ones — Qwen3 has none, so RMSNorm scales are
        # decayed too (HF's default would exempt them).
        return [name for name, _ in model.named_parameters()]

    uses_token_budget_sampler = True

    def _get_train_sampler(self, train_dataset=None):
        # Token-budget batching (`hf_loops.training.token_budget.apply_token_budget`) installs its batch sampler here.
        sampler = getattr(self, "token_budget_sampler", None)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def warmup_threshold(self, model) -> float | None:
        """τ of this training step under the threshold warm-up (None when off or done): τ·step/base_warmup_steps,
        kept inside (0, 1) — at τ ≈ 0 every token continues, so the updater learns at every depth before the
        decider may stop tokens."""
        n = self.args.base_warmup_steps
        step = self.state.global_step
        if not n or step >= n or not model.training:
            return None
        core = _unwrap(model)
        if getattr(core.config, "decider", None) != "learned":
            return None
        return max(core.config.exit_threshold * step / n, 1e-6)

    def tah2_loss(self, model, inputs, num_items_in_batch=None, return_logits: bool = False):
        tau = self.warmup_threshold(model)
        if tau is not None:
            inputs = {**inputs, "exit_threshold": tau}
        return tah2_joint_loss(model, inputs, self.args, num_items_in_batch, return_logits=return_logits)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        # Evaluation/prediction asks for the outputs when it needs logits (compute_metrics, predict): return the
        # mixture's log-probabilities then. Pass `preprocess_logits_for_metrics` to the trainer to reduce them per
        # batch (e.g. to argmax ids) where keeping (B, T, V) for the whole eval set would take too much memory.
        loss, outputs, metrics = self.tah2_loss(model, inputs, num_items_in_batch,
                                                return_logits=return_outputs and not model.training)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and model.training:
            loss = loss * self.accelerator.num_processes  # Trainer convention: DDP averages gradients over ranks
        self._record_metrics(mode, metrics)
        return (loss, outputs) if return_outputs else loss

    def _record_metrics(self, mode: str, metrics: dict) -> None:
        """Sum each metric's numerator and denominator over ranks and micro-batches; `log` divides."""
        if not hasattr(self, "_tah2_sums"):
            self._tah2_sums = {"train": {}, "eval": {}}
        keys = sorted(metrics)
        device = self.accelerator.device
        pairs = torch.stack([torch.stack([torch.as_tensor(metrics[k][0], dtype=torch.float64, device=device),
                                          torch.as_tensor(metrics[k][1], dtype=torch.float64, device=device)])
                             for k in keys])
        if self.accelerator.num_processes > 1:
            pairs = self.accelerator.reduce(pairs, reduction="sum")  # one collective for every metric
        sums = self._tah2_sums[mode]
        for key, (num, den) in zip(keys, pairs.tolist(), strict=True):
            if key.startswith(("delta_cut@", "beta@")):  # per-batch values: mean over ranks and micro-batches
                num, den = num / self.accelerator.num_processes, den / self.accelerator.num_processes
            old = sums.get(key, (0.0, 0.0))
            sums[key] = (old[0] + num, old[1] + den)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        sums = getattr(self, "_tah2_sums", {}).get(mode, {})
        for key, (num, den) in sums.items():
            self._metrics[mode][key] = [num / den if den > 0 else 0.0]
        sums.clear()
        super().log(logs, start_time)
