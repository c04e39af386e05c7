"""What every `hf-loops reproduce` run shares: the shipped text split by characters into train / validation / test token
blocks, one seeded training loop (AdamW, warm-up then cosine, the same block order for every arch of a seed), the
held-out loss, and mean ± std."""

from __future__ import annotations

import math
import os

from ..demo.stats import pm, spread  # the reproductions' mean ± std: the demo's

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


def load_data(t: dict, threads: int = 1):
    """(tokenizer, train, validation, test blocks) of a run's settings `t`: the embedded base's tokenizer on the
    shipped text (its first `t["max_chars"]` characters where given), cut into `t["seq_len"]`-token blocks; torch set to
    `threads` threads."""
    import torch
    from transformers import AutoTokenizer

    from ..data import default_base_dir

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(default_base_dir())
    ids = corpus_splits(tok, t.get("max_chars"))
    return (tok, *(blocks(ids[k], t["seq_len"]) for k in ("train", "validation", "test")))


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


def check_run_settings(seeds, training: dict, steps: int | None, lr: float | None) -> tuple[tuple[int, ...], dict]:
    """The seeds (distinct, at least one) and the training settings with `--steps` / `--lr` applied, each checked."""
    from ..core.numbers import check_float, check_int

    seeds = tuple(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: need distinct seeds, got {seeds}")
    training = dict(training)
    if steps is not None:
        check_int("--steps", steps, 1)
        training["steps"] = steps
    if lr is not None:
        check_float("--lr", lr, 0, 1, low_open=True)
        training["lr"] = lr
    return seeds, training


def plot_validation_curves(runs: dict, labels: dict, colors: dict, path: str) -> None:
    """Validation loss against step, one line per (arch, seed) of `runs` (`{(arch, seed): {"curve": ...}}`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = {a: min(s for b, s in runs if b == a) for a, _ in runs}
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=110)
    for (arch, seed), r in sorted(runs.items()):
        c = r["curve"]
        ax.plot([p["step"] for p in c], [p["validation_loss"] for p in c], color=colors[arch], alpha=0.8,
                label=labels[arch] if seed == first[arch] else None)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("validation loss, every seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_reproduction(out: str, overwrite: bool, make_jobs, fn, workers: int | None, write) -> dict:
    """The common frame of a reproduction: `make_jobs(tmp)` → jobs (each with `arch`, `seed`, `out`, `keep`),
    `run_jobs(jobs, workers, fn=fn)`, the folders of the runs not kept removed, then `write(tmp, runs)` (`runs`:
    `{(arch, seed): result}`) writes summary.json, report.md and the pictures into `tmp` and returns what the
    command prints. Written atomically into `out`."""
    import shutil

    from ..demo.runs import run_jobs
    from ..evaluation.report import output_dir

    with output_dir(out, overwrite, "--out") as tmp:
        jobs = make_jobs(tmp)
        results = run_jobs(jobs, workers, fn=fn)
        for j in jobs:
            if not j.keep and os.path.isdir(j.out):
                shutil.rmtree(j.out)
        res = write(tmp, {(j.arch, j.seed): r for j, r in zip(jobs, results, strict=True)})
    return {**res, "out": os.path.abspath(out)}


def write_summary(tmp: str, summary: dict, runs: dict, model: dict, training: dict, seeds) -> None:
    """summary.json and runs.json (every run's fields and curve, the settings)."""
    import json

    with open(os.path.join(tmp, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(tmp, "runs.json"), "w", encoding="utf-8") as f:
        json.dump({"model": model, "training": training, "seeds": list(seeds),
                   "runs": [{"arch": a, "seed": s, **r} for (a, s), r in runs.items()]}, f, indent=1)


def write_report(tmp: str, name: str, quick: bool, seeds, n_archs: int, training: dict, model: dict,
                 seconds: float, first_table: str, verdicts, sections: list[str]) -> None:
    """report.md of a reproduction: the title, what ran, `first_table`, the claims with their verdicts, the
    `sections` (markdown lines: more tables, the pictures) and the settings."""
    import json

    lines = [
        f"# hf-loops reproduce {name}" + (" (--quick: a smoke run, not a result)" if quick else ""),
        "",
        f"{len(seeds)} seeds × {n_archs} runs, {training['steps']} steps of {training['batch_size']} × "
        f"{training['seq_len']} tokens each, the same blocks in the same order per seed; held-out loss on the "
        f"test split (the last 5 % of the shipped Shakespeare slice). {seconds:.0f} s wall.",
        "",
        first_table,
        "",
        "## The paper's claims, tested",
        "",
        *(f"- **{'held' if ok else 'did not hold'}:** {n} ({t})" for n, ok, t in verdicts),
        "",
        *sections,
        "## Settings",
        "",
        "```json",
        json.dumps({"model": model, "training": training}, indent=1),
        "```",
    ]
    with open(os.path.join(tmp, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


__all__ = ["SPLITS", "blocks", "check_run_settings", "load_data", "write_report", "plot_validation_curves", "run_reproduction", "write_summary", "corpus_splits", "mean_loss", "pm", "spread", "train_lm"]
