"""`hf-loops reproduce spiralformer`: does multi-resolution recursion beat a same-size LoopedFormer at fewer FLOPs?

The paper's claims (SpiralFormer, Table 1 and Fig. 4): SpiralFormer-B (the shared core looped at chunk sizes
{8, 4, 2, 1}, coarse → fine) reaches a lower perplexity than LoopedFormer (the same split looped twice at full
resolution, {1, 1}) at 0.90–0.93× its prefill FLOPs; and its loops go from global to local attention (local attention
mass rises, key-marginal entropy falls from the first loop to the last).

What runs: Standard (the same 4 physical layers, one pass), LoopedFormer {1, 1} and SpiralFormer-B {8, 4, 2, 1}, each
pre 1 + core 2 + post 1 layers of width 128, from the same seeds on the same token blocks of the shipped Shakespeare
slice (`hf_loops.data.corpus_path()`, public domain; tokenised with the embedded base's 8k BPE tokenizer), the same
optimizer, schedule and steps. The text is split by characters: the first 90 % trains, the next 5 % is the validation
split (the recipe and the learning-rate choice were made there), the last 5 % the held-out test split. Every run
reports its test loss, its validation curve, its prefill FLOPs (`hf_loops.core.flops_spiralformer`) ÷ LoopedFormer's,
and, for the looped runs, the per-loop probes of `hf_loops.analysis.analyze` (the paper's definitions; the 40 % most
dynamic heads) on held-out text.

Writes OUT/summary.json (`{"claims": ..., "archs": {ARCH: {"seeds": {SEED: FIELDS}}}}`), OUT/report.md, OUT/runs.json,
OUT/loss_curves.png, OUT/coarse_to_fine.png and OUT/ARCH-seed0/ (the first seed's checkpoints).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from .common import load_data, mean_loss, plot_validation_curves, pm, train_lm

ARCHS = ("standard", "looped", "spiral-b")
LABELS = {"standard": "Standard (4 layers, 1 pass)", "looped": "LoopedFormer {1,1}",
          "spiral-b": "SpiralFormer-B {8,4,2,1}"}
CHUNKS = {"looped": [1, 1], "spiral-b": [8, 4, 2, 1]}
SEEDS = (0, 1, 2)
# Model and training settings of the full run; `QUICK` shrinks them for the tests (`--quick`).
MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_pre_layers": 1, "num_loop_layers": 2, "num_post_layers": 1}
TRAINING = {"seq_len": 512, "batch_size": 4, "steps": 200, "lr": 3e-3, "warmup_steps": 10, "min_lr_rate": 0.1,
            "beta2": 0.95, "weight_decay": 0.01, "grad_clip": 1.0, "eval_every": 50, "probe_texts": 8}
QUICK_MODEL = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 16}
QUICK = {**TRAINING, "seq_len": 64, "batch_size": 2, "steps": 3, "eval_every": 3, "probe_texts": 2,
         "max_chars": 60_000}


@dataclass(frozen=True)
class SpiralJob:
    """One (arch, seed) run; plain fields, so it travels to a spawned worker."""

    arch: str
    seed: int
    model: dict
    training: dict
    out: str  # the run's folder (its checkpoint and analysis)
    keep: bool = False
    threads: int = 1
    settings: dict = field(default_factory=dict)  # unused by the run: `run_jobs` sorts by max_steps


def build_spiral_model(arch: str, vocab_size: int, model: dict, seq_len: int, pad_token_id: int, **overrides):
    """Standard = a Qwen3 with the split's layers once; the looped two = a SpiralFormer with their chunk sizes (and
    `overrides` of its config fields, e.g. `topology="anchor"`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..modeling.configuration_spiralformer import SpiralFormerConfig
    from ..modeling.modeling_spiralformer import SpiralFormerForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    split = {k: model[k] for k in ("num_pre_layers", "num_loop_layers", "num_post_layers")}
    common = {k: v for k, v in model.items() if k not in split}
    common.update(vocab_size=vocab_size, max_position_embeddings=seq_len, tie_word_embeddings=True,
                  pad_token_id=pad_token_id)
    if arch == "standard":
        return Qwen3ForCausalLM(Qwen3Config(**common, num_hidden_layers=sum(split.values())))
    return SpiralFormerForCausalLM(SpiralFormerConfig(**common, **split, chunk_sizes=CHUNKS[arch], **overrides))


def prefill_flops(config, seq_len: int) -> float:
    """Prefill FLOPs for `seq_len` tokens: SpiralFormer's accounting for the looped models, every layer once plus the
    LM head for Standard (the same per-layer formula)."""
    from ..core.flops_spiralformer import SpiralShape, forward_flops, layer_flops

    shape = SpiralShape.from_config(config)
    if config.model_type == "qwen3":
        return config.num_hidden_layers * layer_flops(seq_len, shape) + 2 * config.hidden_size * config.vocab_size * seq_len
    return forward_flops(shape, seq_len)


def run_spiral_one(job: SpiralJob) -> dict:
    """Train one arch from `job.seed`, evaluate it, probe its loops; returns its FIELDS and curve."""
    import torch

    t0 = time.perf_counter()
    t = job.training
    tok, train, val, test = load_data(t, job.threads)
    torch.manual_seed(job.seed)
    model = build_spiral_model(job.arch, len(tok), job.model, t["seq_len"], tok.pad_token_id)
    params = sum(p.numel() for p in model.parameters())
    curve = train_lm(model, train, val, t, job.seed)
    train_s = time.perf_counter() - t0
    fields = {"test_loss": mean_loss(model, test, 8), "validation_loss": curve[-1]["validation_loss"],
              "prefill_flops": prefill_flops(model.config, t["seq_len"]), "parameters": params,
              "train_seconds": train_s, "tokens": t["steps"] * t["batch_size"] * t["seq_len"]}
    if job.arch != "standard":
        fields["probes"] = _probes(model, tok, test, t, os.path.join(job.out, "analysis"))
    if job.keep:
        model.save_pretrained(job.out)
        tok.save_pretrained(job.out)
    print(f"[reproduce] spiralformer seed {job.seed}: {job.arch} done ({time.perf_counter() - t0:.0f} s, test loss "
          f"{fields['test_loss']:.3f})", flush=True)
    return {"fields": fields, "curve": curve}


def _probes(model, tokenizer, test, t: dict, out: str) -> dict:
    """Key-marginal entropy and local attention mass per loop (dynamic heads), from `analysis.analyze`."""
    from ..analysis.analyze import analyze

    texts = [tokenizer.decode(row) for row in test[: t["probe_texts"]]]
    res = analyze(model, tokenizer, texts, out, metrics=("attention",), progress=False, name="run",
                  max_length=t["seq_len"], groupings=("none",))
    c2f = res.get("coarse_to_fine") or res.get("loop_attention_scope")
    if c2f is None:
        raise RuntimeError("the analysis gave no per-loop attention probes")
    return {"key_marginal_entropy": c2f["key_marginal_entropy"]["dynamic_heads"],
            "local_attention_mass": c2f["local_attention_mass"]["dynamic_heads"],
            "resolutions": c2f["resolutions"]}


def spiral_aggregate(runs: dict) -> dict:
    """FIELDS per arch and seed with the FLOPs ratio to LoopedFormer of the same seed."""
    archs = {}
    for (arch, seed), r in runs.items():
        f = dict(r["fields"])
        f["prefill_flops_ratio"] = f["prefill_flops"] / runs["looped", seed]["fields"]["prefill_flops"]
        archs.setdefault(arch, {"seeds": {}})["seeds"][str(seed)] = f
    return archs


def spiral_claims(archs: dict) -> list[tuple[str, bool, str]]:
    """The paper's claims on the measured numbers: (name, held, the numbers)."""
    sp, lo = archs["spiral-b"]["seeds"], archs["looped"]["seeds"]
    seeds = sorted(sp, key=int)
    wins = sum(sp[s]["test_loss"] <= lo[s]["test_loss"] for s in seeds)
    ratio = statistics.fmean(sp[s]["prefill_flops_ratio"] for s in seeds)
    d = statistics.fmean(sp[s]["test_loss"] - lo[s]["test_loss"] for s in seeds)
    out = [("SpiralFormer-B's held-out loss ≤ LoopedFormer's in every seed at ≤ 0.95× its prefill FLOPs",
            wins == len(seeds) and ratio <= 0.95,
            f"lower or equal in {wins} of {len(seeds)} seeds, mean difference {d:+.4f} nats/token; prefill FLOPs "
            f"{ratio:.3f}× LoopedFormer")]
    lam = [sp[s]["probes"]["local_attention_mass"] for s in seeds]
    hkm = [sp[s]["probes"]["key_marginal_entropy"] for s in seeds]
    lam_up = sum(v[-1] > v[0] for v in lam)
    hkm_down = sum(v[-1] < v[0] for v in hkm)
    out.append(("coarse → fine: local attention mass rises from the first loop to the last (every seed)",
                lam_up == len(seeds),
                f"rises in {lam_up} of {len(seeds)} seeds; first → last loop "
                f"{pm([v[0] for v in lam])} → {pm([v[-1] for v in lam])}"))
    out.append(("coarse → fine: key-marginal entropy falls from the first loop to the last (every seed)",
                hkm_down == len(seeds),
                f"falls in {hkm_down} of {len(seeds)} seeds; first → last loop "
                f"{pm([v[0] for v in hkm])} → {pm([v[-1] for v in hkm])}"))
    return out


def table(archs: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "parameters", "held-out loss (nats/token)", "per seed", "validation loss",
               "prefill FLOPs ÷ LoopedFormer", "training time (s)"]
    rows = []
    for arch in ARCHS:
        fs = [archs[arch]["seeds"][s] for s in sorted(archs[arch]["seeds"], key=int)]
        rows.append([LABELS[arch], f"{fs[0]['parameters']:,}", pm([f["test_loss"] for f in fs], ".4f"),
                     " / ".join(f"{f['test_loss']:.4f}" for f in fs), pm([f["validation_loss"] for f in fs], ".4f"),
                     f"{statistics.fmean(f['prefill_flops_ratio'] for f in fs):.3f}×",
                     pm([f["train_seconds"] for f in fs], ".0f")])
    return headers, rows


def probe_table(archs: dict) -> tuple[list[str], list[list[str]]]:
    rows = []
    for arch in ("looped", "spiral-b"):
        fs = [archs[arch]["seeds"][s]["probes"] for s in sorted(archs[arch]["seeds"], key=int)]
        for t, r in enumerate(fs[0]["resolutions"]):
            rows.append([LABELS[arch], f"{t + 1} (r = {r:g})", pm([f["local_attention_mass"][t] for f in fs]),
                         pm([f["key_marginal_entropy"][t] for f in fs])])
    return ["run", "loop", "local attention mass", "key-marginal entropy (normalised)"], rows


def _plots(archs: dict, runs: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"standard": "#8fa3bf", "looped": "#4c956c", "spiral-b": "#c44e12"}
    plot_validation_curves(runs, LABELS, colors, os.path.join(out, "loss_curves.png"))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=110)
    for ax, key, title in ((axes[0], "local_attention_mass", "local attention mass"),
                           (axes[1], "key_marginal_entropy", "key-marginal entropy (normalised)")):
        for arch in ("looped", "spiral-b"):
            for seed, f in archs[arch]["seeds"].items():
                v = f["probes"][key]
                ax.plot(range(1, len(v) + 1), v, marker="o", color=colors[arch], alpha=0.8,
                        label=LABELS[arch] if seed == min(archs[arch]["seeds"], key=int) else None)
        ax.set_xlabel("loop (coarse → fine for SpiralFormer)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "coarse_to_fine.png"))
    plt.close(fig)


def run_spiralformer(out: str, seeds=SEEDS, quick: bool = False, overwrite: bool = False,
                     workers: int | None = None, steps: int | None = None, lr: float | None = None) -> dict:
    """Every arch × seed, then summary.json, report.md, runs.json, pictures and the first seed's checkpoints."""
    from ..evaluation.report import markdown_table
    from .common import check_run_settings, run_reproduction, write_report, write_summary

    seeds, training = check_run_settings(seeds, QUICK if quick else TRAINING, steps, lr)
    model = QUICK_MODEL if quick else MODEL
    t_start = time.perf_counter()

    def make_jobs(tmp):
        return [SpiralJob(arch, seed, model, training, os.path.join(tmp, f"{arch}-seed{seed}"), keep=seed == seeds[0],
                        settings={"max_steps": training["steps"], "max_length": training["seq_len"]})
                for seed in seeds for arch in ARCHS]

    def write(tmp, runs):
        archs = spiral_aggregate(runs)
        verdicts = spiral_claims(archs)
        summary = {"claims": [{"claim": n, "held": ok, "numbers": t} for n, ok, t in verdicts], "archs": archs}
        write_summary(tmp, summary, runs, model, training, seeds)
        _plots(archs, runs, tmp)
        seconds = time.perf_counter() - t_start
        write_report(tmp, "spiralformer", quick, seeds, len(ARCHS), training, model, seconds, markdown_table(*table(archs)),
                     verdicts, [
            "## Attention scope per loop (dynamic heads, held-out text)",
            "",
            markdown_table(*probe_table(archs)),
            "",
            "![validation loss](loss_curves.png)",
            "",
            "![coarse to fine](coarse_to_fine.png)",
            "",
        ])
        return {"summary": summary, "tables": [table(archs), probe_table(archs)], "claims": verdicts,
                "files": "summary.json, report.md, runs.json, loss_curves.png, coarse_to_fine.png"}

    res = run_reproduction(out, overwrite, make_jobs, run_spiral_one, workers, write)
    return {**res, "seconds": time.perf_counter() - t_start}


__all__ = ["ARCHS", "MODEL", "QUICK", "TRAINING", "build_spiral_model", "prefill_flops", "run_spiral_one", "run_spiralformer",
           "spiral_aggregate", "spiral_claims"]
