"""TRL SFT trainer for TaH2 with lookahead depth supervision (spec: tah2.md §4).

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

from .tah2_labels import compute_depth_labels, decider_bce_sum


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

    def __post_init__(self):
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
        super().__post_init__()

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
        and cfg.iteration_attention != "causal"  # no lookahead in causal/fixed mode (spec §4.2)
    )


def tah2_joint_loss(model, inputs, args, num_items_in_batch=None):
    """(loss, outputs, metrics) of one micro-batch (Eq. 7): mixture NLL + α_D · weighted decider BCE, both divided
    by the supervised-token count N (`num_items_in_batch`, the Trainer's convention, else this batch's count).
    `args` carries the supervision knobs (a `TaH2SFTConfig`)."""
    core = _unwrap(model)
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    lookahead = uses_lookahead(core, args)
    outputs = model(**inputs, labels=labels, use_cache=False, return_loop_records=lookahead,
                    num_items_in_batch=num_items_in_batch)
    ntp = outputs.loss
    loss = ntp
    metrics = {"ntp_loss": ntp.detach()}
    supervised = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100) != -100
    depths = outputs.iter_counts
    metrics["mean_depth"] = (depths[supervised].float().mean() if supervised.any() else depths.float().mean()).detach()
    M = core.config.max_iterations
    for m in range(1, M):  # every rank logs every key (gather_for_metrics is a collective)
        ran = depths >= m
        metrics[f"continue_rate@{m}"] = ((depths > m) & ran).sum().float() / ran.sum().clamp(min=1)
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
        n = num_items_in_batch if num_items_in_batch is not None else (rec.targets != -100).sum()
        n = torch.as_tensor(n, device=ntp.device).clamp(min=1)
        bce = decider_bce_sum(rec.decider_logits, labels_d, margin=args.bce_margin).to(ntp.device) / n
        loss = ntp + args.decider_loss_weight * bce
        metrics["decider_loss"] = bce.detach()
        threshold_logit = torch.logit(torch.tensor(core.config.exit_threshold))
        for m in range(1, M):
            c, terms = labels_d.continue_labels[m - 1], labels_d.bce_mask[m - 1]
            n_terms = terms.sum().clamp(min=1).float()
            metrics[f"delta_cut@{m}"] = torch.tensor(labels_d.delta_cut[m - 1])
            metrics[f"beta@{m}"] = torch.tensor(labels_d.beta[m - 1])
            metrics[f"label_continue_rate@{m}"] = (c & terms).sum().float() / n_terms
            if m - 1 < len(rec.decider_logits):
                pred = rec.decider_logits[m - 1].detach() > threshold_logit
                metrics[f"decider_acc@{m}"] = ((pred == c) & terms).sum().float() / n_terms
            else:
                metrics[f"decider_acc@{m}"] = torch.tensor(0.0)
        outputs.depth_labels = labels_d
    # Updater/decider parameters a step did not use still get a (zero) gradient: DDP needs every parameter used.
    extra = [p for part in (core.updater, core.decider) if part is not None for p in part.parameters() if p.requires_grad]
    if extra and model.training:
        loss = loss + 0.0 * sum(p.sum() for p in extra)
    return loss, outputs, metrics


class TaH2SFTTrainer(SFTTrainer):
    """`SFTTrainer` whose loss is TaH2's joint objective (Eq. 7) with lookahead labels."""

    def get_decay_parameter_names(self, model) -> list[str]:
        # The official recipe decays every parameter except nn.LayerNorm ones — Qwen3 has none, so RMSNorm scales are
        # decayed too (HF's default would exempt them).
        return [name for name, _ in model.named_parameters()]

    def tah2_loss(self, model, inputs, num_items_in_batch=None):
        return tah2_joint_loss(model, inputs, self.args, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        loss, outputs, metrics = self.tah2_loss(model, inputs, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and model.training:
            loss = loss * self.accelerator.num_processes  # Trainer convention: DDP averages gradients over ranks
        for key, value in metrics.items():
            value = torch.as_tensor(value, device=self.accelerator.device, dtype=torch.float32)
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value.reshape(1)).mean().item())
        return (loss, outputs) if return_outputs else loss
