"""Token-budget batching: the paper's global batch on any process count (docs/recipes.md).

The TaH2 paper trains with a global batch of 128 samples per optimizer step, cut into micro-batches of at most
16,384 tokens (≤ 32 samples each), and excludes samples longer than the 16,384-token maximum length. A fixed
`per_device_train_batch_size × gradient_accumulation_steps` reaches that global batch on one GPU count only, and a
fixed micro-batch of 16K-token samples runs out of memory. `TokenBudgetBatchSampler` does what the paper does within
the Trainer's fixed accumulation count:

1. drop the samples longer than `max_length` (or than the budget itself), and say how many;
2. per optimizer step take the next `global_batch_size` samples of a seeded shuffle (the same on every rank), deal
   them to the ranks (equal sample counts ± 1, longest first to the rank with the fewest tokens);
3. on each rank pack its share first-fit-decreasing into micro-batches of at most `max_tokens_per_batch` tokens
   (real tokens with padding-free batches; `samples × longest` for padded ones) and `max_samples_per_batch` samples;
4. split the fullest micro-batches until every rank has exactly `gradient_accumulation_steps` of them, where that
   count is derived up front as the most micro-batches any (step, rank) needs over the planned epochs.

Every optimizer step therefore sees exactly `global_batch_size` samples whatever the number of processes; the Trainer
normalises the loss by the step's supervised-token count, so micro-batches of different sizes weigh by their tokens.
δ_cut and β (TaH2's lookahead labels) are pooled per micro-batch over all its samples and over the ranks, as before.

Without `max_tokens_per_batch`, `global_batch_size` alone derives `gradient_accumulation_steps` for the configured
`per_device_train_batch_size` and the number of processes. Both print their derivation when training starts.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

OPTION_NAMES = ("max_tokens_per_batch", "global_batch_size", "max_samples_per_batch")


def pack_micro_batches(indices, lengths, max_tokens: int, padded: bool = False,
                       max_samples: int | None = None) -> list[list[int]]:
    """First-fit-decreasing packing of `indices` into micro-batches within `max_tokens` (and `max_samples`). A
    micro-batch's tokens: the sum of its lengths (padding-free), or samples × longest (`padded`)."""
    bins: list[list[int]] = []
    totals: list[int] = []  # running token sums; with padding, a bin's longest is its first (longest-first order)
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for k, b in enumerate(bins):
            if max_samples is not None and len(b) >= max_samples:
                continue
            cost = (len(b) + 1) * lengths[b[0]] if padded else totals[k] + n
            if cost <= max_tokens:
                b.append(i)
                totals[k] += n
                break
        else:
            bins.append([i])
            totals.append(n)
    return bins


def split_to_count(bins: list[list[int]], count: int) -> list[list[int]]:
    """Split the micro-batches with the most samples in two until there are `count` (a part of a micro-batch that fits
    the budget fits too)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        k = max(range(len(bins)), key=lambda j: len(bins[j]))
        if len(bins[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {sum(map(len, bins))} samples")
        b = bins.pop(k)
        bins[k:k] = [b[0::2], b[1::2]]  # b is sorted longest first: both halves get long and short samples
    return bins


def deal_to_ranks(indices, lengths, dp_size: int) -> list[list[int]]:
    """Deal one step's samples to `dp_size` ranks: counts differ by at most one; longest first to the rank with the
    fewest tokens so far (ties: the lower rank)."""
    quota = [len(indices) // dp_size + (1 if r < len(indices) % dp_size else 0) for r in range(dp_size)]
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(dp_size) if len(shares[r]) < quota[r]), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares


class TokenBudgetBatchSampler(BatchRebalanceSampler):
    """Rank-aware batch sampler: `global_batch_size` samples per optimizer step, `grad_accum` micro-batches of at most
    `max_tokens_per_batch` tokens per rank (see the module docstring). A `BatchRebalanceSampler` subclass so that
    the Trainer passes it to the DataLoader as its `batch_sampler` and does not shard it again."""

    def __init__(self, lengths, max_tokens_per_batch: int, global_batch_size: int, *, max_length: int | None = None,
                 max_samples_per_batch: int | None = None, dp_size: int = 1, rank: int = 0, padded: bool = False,
                 seed: int = 42, shuffle: bool = True, num_epochs: int = 1):
        for name, value, low in (("max_tokens_per_batch", max_tokens_per_batch, 1),
                                 ("global_batch_size", global_batch_size, 1), ("dp_size", dp_size, 1),
                                 ("num_epochs", num_epochs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_samples_per_batch is not None and (not isinstance(max_samples_per_batch, int)
                                                  or max_samples_per_batch < 1):
            raise ValueError(f"max_samples_per_batch must be an integer >= 1 or None, got {max_samples_per_batch!r}")
        if global_batch_size < dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is smaller than the {dp_size} processes")
        self.lengths = [int(n) for n in lengths]
        self.max_tokens_per_batch, self.global_batch_size = max_tokens_per_batch, global_batch_size
        self.max_length, self.max_samples_per_batch = max_length, max_samples_per_batch
        self.dp_size, self.rank, self.padded = dp_size, rank, padded
        self.seed, self.shuffle, self.num_epochs, self.epoch = seed, shuffle, num_epochs, 0
        limit = max_tokens_per_batch if max_length is None else min(max_length, max_tokens_per_batch)
        self.kept = [i for i, n in enumerate(self.lengths) if 0 < n <= limit]
        self.dropped = len(self.lengths) - len(self.kept)
        self.steps_per_epoch = len(self.kept) // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.kept)} samples fit max_length/max_tokens_per_batch ({self.dropped} dropped), "
                             f"fewer than one global batch of {global_batch_size}")
        self._plans: dict[int, list] = {}
        needed = max(len(bins) for e in range(num_epochs) for step in self._packed(e) for bins in step)
        smallest_share = global_batch_size // dp_size
        if needed > smallest_share:
            raise ValueError(f"a step needs {needed} micro-batches but a rank gets only {smallest_share} samples; "
                             "raise global_batch_size or max_tokens_per_batch")
        self.grad_accum = needed
        # BatchRebalanceSampler fields the Trainer may read
        self.effective_batch_size, self.drop_last = global_batch_size, True

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(self.kept)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return [self.kept[i] for i in torch.randperm(len(self.kept), generator=g).tolist()]

    def _packed(self, epoch: int) -> list[list[list[list[int]]]]:
        """[step][rank] → micro-batches (FFD, before splitting to the common count)."""
        if epoch not in self._plans:
            order, G = self._order(epoch), self.global_batch_size
            self._plans[epoch] = [
                [pack_micro_batches(share, self.lengths, self.max_tokens_per_batch, self.padded,
                                    self.max_samples_per_batch)
                 for share in deal_to_ranks(order[s * G:(s + 1) * G], self.lengths, self.dp_size)]
                for s in range(self.steps_per_epoch)
            ]
        return self._plans[epoch]

    def step_batches(self, epoch: int, step: int, rank: int | None = None) -> list[list[int]]:
        """The `grad_accum` micro-batches (dataset indices) of `rank` at `step` of `epoch`."""
        # epochs past the planned ones reuse the planned shuffles, so the accumulation count stays valid
        bins = self._packed(epoch % self.num_epochs)[step][self.rank if rank is None else rank]
        return split_to_count(bins, self.grad_accum)

    def __iter__(self):
        for step in range(self.steps_per_epoch):
            yield from self.step_batches(self.epoch, step)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.grad_accum


@dataclass
class TokenBudget:
    """The batching options a recipe or command line may give beside the trainer fields (see the module docstring).

    `max_length` is the trainer's, taken over by `detach_max_length` so that TRL does not truncate the samples the
    sampler is meant to drop."""

    max_tokens_per_batch: int | None = None
    global_batch_size: int | None = None
    max_samples_per_batch: int | None = None
    max_length: int | None = None

    def detach_max_length(self, trainer_args) -> None:
        """Call before building the trainer: with a token budget, over-long samples are dropped, not truncated."""
        if self.max_tokens_per_batch is not None:
            self.max_length, trainer_args.max_length = trainer_args.max_length, None


def _parse_option(name: str, value):
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer or none, got {value!r}") from None
    if isinstance(value, bool) or out < 1 or (isinstance(value, float) and value != out):
        raise ValueError(f"{name} must be a positive integer or none, got {value!r}")
    return out


def pop_token_budget(recipe: dict, rest: list[str]) -> TokenBudget | None:
    """Take the token-budget options out of a recipe dict and a command-line remainder (both edited in place; the
    command line wins). None when neither `max_tokens_per_batch` nor `global_batch_size` is set."""
    values = {name: recipe.pop(name) for name in OPTION_NAMES if name in recipe}
    i = 0
    while i < len(rest):
        flag, eq, inline = rest[i].partition("=")
        name = flag[2:].replace("-", "_") if flag.startswith("--") else None
        if name in OPTION_NAMES:
            if eq:
                values[name] = inline
                del rest[i]
            elif i + 1 < len(rest):
                values[name] = rest[i + 1]
                del rest[i:i + 2]
            else:
                raise ValueError(f"--{name} needs a value")
            continue
        i += 1
    budget = TokenBudget(**{name: _parse_option(name, v) for name, v in values.items()})
    if budget.max_tokens_per_batch is None and budget.global_batch_size is None:
        return None
    return budget


def _say(trainer, text: str) -> None:
    if trainer.args.process_index == 0:
        print(text, file=sys.stderr)


def derived_accumulation(global_batch_size: int, per_device: int, num_processes: int) -> int:
    """gradient_accumulation_steps for a fixed micro-batch: ⌈global / (per_device × processes)⌉."""
    return max(1, math.ceil(global_batch_size / (per_device * num_processes)))


def apply_token_budget(trainer, budget: TokenBudget | None):
    """Install `budget` on a built (TRL/HF) trainer: the token-budget batch sampler and the derived
    `gradient_accumulation_steps` (or only the latter without a token budget). Prints the derivation. Returns the
    sampler (None without a token budget)."""
    if budget is None:
        return None
    args = trainer.args
    world = max(1, args.world_size)
    if budget.max_tokens_per_batch is None:  # fixed micro-batches: derive the accumulation only
        per_device = args.per_device_train_batch_size
        ga = derived_accumulation(budget.global_batch_size, per_device, world)
        _set_accumulation(trainer, ga)
        got = per_device * ga * world
        _say(trainer, f"note: global batch {budget.global_batch_size} samples = {world} process(es) × "
                      f"{per_device} per device × gradient_accumulation_steps {ga}"
                      + ("" if got == budget.global_batch_size else f" (gives {got}: not divisible)"))
        return None
    dataset = trainer.train_dataset
    if dataset is None or "input_ids" not in (getattr(dataset, "column_names", None) or []):
        raise ValueError("max_tokens_per_batch needs a tokenised training dataset with an 'input_ids' column")
    lengths = [len(ids) for ids in dataset["input_ids"]]
    global_batch = budget.global_batch_size or args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if budget.max_length is not None:
        args.max_length = budget.max_length  # for the run record; TRL has prepared the dataset without truncation
    max_length = args.max_length
    if args.max_steps and args.max_steps > 0:
        steps_per_epoch = max(1, sum(0 < n <= min(max_length or n, budget.max_tokens_per_batch) for n in lengths)
                              // global_batch)
        epochs = math.ceil(args.max_steps / steps_per_epoch)
    else:
        epochs = math.ceil(args.num_train_epochs)
    sampler = TokenBudgetBatchSampler(
        lengths, budget.max_tokens_per_batch, global_batch, max_length=max_length,
        max_samples_per_batch=budget.max_samples_per_batch, dp_size=world, rank=args.process_index if world > 1 else 0,
        padded=not getattr(args, "padding_free", False), seed=args.seed, num_epochs=max(1, epochs),
    )
    _set_accumulation(trainer, sampler.grad_accum)
    trainer.token_budget_sampler = sampler
    if not getattr(type(trainer), "uses_token_budget_sampler", False):  # a trainer without the seam
        trainer._get_train_sampler = lambda train_dataset=None: sampler
    share = f"{global_batch // world}" + ("" if global_batch % world == 0 else f"–{global_batch // world + 1}")
    limit = budget.max_tokens_per_batch if max_length is None else min(max_length, budget.max_tokens_per_batch)
    _say(trainer, f"note: token budget {budget.max_tokens_per_batch} tokens per micro-batch "
                  f"({'padding-free' if not sampler.padded else 'padded: samples × longest'}"
                  + (f", ≤ {budget.max_samples_per_batch} samples" if budget.max_samples_per_batch else "") + "); "
                  f"global batch {global_batch} samples = {world} process(es) × {share} samples, packed into "
                  f"gradient_accumulation_steps = {sampler.grad_accum} micro-batches (the most any step needs over "
                  f"{sampler.num_epochs} epoch(s)); {sampler.steps_per_epoch} steps per epoch")
    _say(trainer, f"note: dropped {sampler.dropped} of {len(lengths)} training samples longer than {limit} tokens")
    return sampler


def _set_accumulation(trainer, ga: int) -> None:
    trainer.args.gradient_accumulation_steps = ga
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.gradient_accumulation_steps = ga
