"""What every `hf-loops reproduce` run shares: the shipped text split by characters into train / validation / test token
blocks, one seeded training loop (AdamW, warm-up then cosine, the same block order for every arch of a seed), the
held-out loss, and mean ± std."""

from __future__ import annotations

import math
import statistics

SPLITS = (0.90, 0.95)  # train < 90 % of the characters ≤ validation < 95 % ≤ test


def corpus_splits(tokenizer, max_chars: int | None = None) -> dict[str, list[int]]:
    """Token ids of the train / validation / test character ranges of the shipped text."""
    from ..data import corpus_path

    with open(corpus_path(), encoding="utf-8") as f:
        text = f.read()
    if max_chars:
        text = text[:max_chars]
    a, b = (int(len(text) * s) for s in SPLITS)
    return {name: tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]
            for name, part in (("train", text[:a]), ("validation", text[a:b]), ("test", text[b:]))}


def blocks(ids: list[int], seq_len: int):
    import torch

    n = len(ids) // seq_len
    if n < 1:
        raise ValueError(f"{len(ids)} tokens make no block of {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def _lr_lambda(t: dict):
    def f(step: int) -> float:
        if step < t["warmup_steps"]:
            return (step + 1) / t["warmup_steps"]
        progress = (step - t["warmup_steps"]) / max(1, t["steps"] - t["warmup_steps"])
        return t["min_lr_rate"] + (1 - t["min_lr_rate"]) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


def mean_loss(model, data, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats/token) over every block of `data`."""
    import torch

    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            x = data[i:i + batch_size]
            logits = model(input_ids=x).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total, n = total + loss.item(), n + x[:, 1:].numel()
    model.train()
    return total / n


def train_lm(model, train, val, t: dict, seed: int, on_step=None) -> list[dict]:
    """Train `model` on `train` blocks for `t["steps"]` AdamW steps; the validation loss every `t["eval_every"]` steps
    (and at the end) is the returned curve. The block order depends on `seed` only, so every arch of a seed sees the
    same blocks in the same order. `on_step(step, model)` runs after each optimizer step (SGT's growth)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, t["beta2"]), weight_decay=t["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(t))
    order = torch.Generator().manual_seed(seed)
    queue: list[int] = []
    curve = []
    model.train()
    for step in range(1, t["steps"] + 1):
        if len(queue) < t["batch_size"]:
            queue += torch.randperm(len(train), generator=order).tolist()
        batch, queue = train[queue[:t["batch_size"]]], queue[t["batch_size"]:]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, model)
        if step % t["eval_every"] == 0 or step == t["steps"]:
            curve.append({"step": step, "train_loss": loss.item(), "validation_loss": mean_loss(model, val, 8)})
    return curve


def spread(values) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(values, spec=".3f") -> str:
    m, s = spread(values)
    return f"{m:{spec}} ± {s:{spec}}"


__all__ = ["SPLITS", "blocks", "corpus_splits", "mean_loss", "pm", "spread", "train_lm"]
