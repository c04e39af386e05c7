"""TaH2 decode rows: tokens/s and decode FLOPs ÷ Standard (efficiency), TaH2-fixed, depth ≈ 1.2, KV bytes.

Standard, TaH2 (adaptive, random decider) and TaH2-fixed are converted from one random Qwen3 (same weights). Decoding
by hand (prefill, then one token per call, `logits_to_keep=1`, greedy token computed, a fixed random continuation
fed); only the decode loop is timed. The TaH2 decider has no bias, so the depth ≈ 1.2 row calibrates the per-call
`exit_threshold` τ as the 80% quantile of the continue probability g of a prefill pass (about 20% of tokens
continue) and reports the depth it realises.
"""

from __future__ import annotations

import torch

from hf_loops import TAH2_PRESETS
from hf_loops.conversion import convert_qwen3
from hf_loops.core.flops_tah2 import decode_flops_fixed, decode_flops_standard, decode_flops_tah2

from .common import (
    Ctx,
    Row,
    Size,
    built,
    error_row,
    interleaved_best,
    judged,
    kv_bytes,
    place,
    qwen3_source,
    random_ids,
    timed,
)

M = 2  # max_iterations of TaH2 and TaH2-fixed
CONTINUE_RATE = 0.2  # the depth ≈ 1.2 row: share of tokens that continue to depth 2
# std of the random decider logit (score weights N(0, 2/√d) on a unit-RMS input), so g spreads over (0, 1)
DECIDER_SPREAD = 2.0


def build_models(size: Size, ctx: Ctx, fixed: bool = True) -> tuple[dict, str]:
    """Standard, TaH2 and (optionally) TaH2-fixed with the same backbone weights, on the run's device."""
    def make():
        qwen = qwen3_source(size)
        models = {"standard": convert_qwen3(qwen, "tah2", seed=0, **TAH2_PRESETS["standard"]),
                  "tah2": convert_qwen3(qwen, "tah2", seed=0, max_iterations=M)}
        if fixed:
            models["tah2-fixed"] = convert_qwen3(qwen, "tah2", seed=0, max_iterations=M, **TAH2_PRESETS["tah2-fixed"])
        return models

    models = built(ctx, make)
    torch.manual_seed(1)
    with torch.no_grad():
        models["tah2"].decider.score.weight.normal_(0.0, DECIDER_SPREAD / size.hidden ** 0.5)
    attn = {name: place(m.eval(), ctx) for name, m in models.items()}
    return models, attn["tah2"]


@torch.no_grad()
def decode(model, ids: torch.Tensor, new_tokens: int, device: str, **kw) -> tuple[float, dict]:
    """Decode `new_tokens` one call each after a prefill; (seconds of the decode loop, {depths, prompt depths,
    cache}). Each step computes the greedy token but feeds the next token of a fixed random continuation: every model
    decodes the same tokens, and the decider sees varied inputs (a random model's greedy output repeats one token)."""
    out = model(ids, use_cache=True, logits_to_keep=1, **kw)
    follow = random_ids(model.config.vocab_size, ids.shape[0], new_tokens, ids.device, seed=3)
    state = {"cache": out.cache, "depths": []}

    def loop():
        for i in range(new_tokens):
            o = model(follow[:, i : i + 1], cache=state["cache"], use_cache=True, logits_to_keep=1, **kw)
            o.logits[:, -1].argmax(-1)
            state["cache"] = o.cache
            state["depths"].append(o.iter_counts[:, -1])

    secs, _ = timed(device, loop)
    return secs, {"depths": torch.stack(state["depths"], 1).cpu(), "prompt_depths": out.iter_counts.cpu(),
                  "cache": state["cache"]}


@torch.no_grad()
def calibrate_tau(model, ids: torch.Tensor, new_tokens: int, rate: float = CONTINUE_RATE) -> float:
    """τ such that a share `rate` of the decoded tokens have g > τ after depth 1. The decode feeds the same fixed
    continuation as `decode`, and a depth-1 query sees only stream 0 (depth-1 states), so g after depth 1 does not
    depend on τ: the timed run with this τ sends that share of its decode tokens to depth 2."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    follow = random_ids(model.config.vocab_size, ids.shape[0], new_tokens, ids.device, seed=3)
    cache, g = out.cache, []
    for i in range(new_tokens):
        o = model(follow[:, i : i + 1], cache=cache, use_cache=True, logits_to_keep=1)
        cache = o.cache
        g.append(o.continue_probs[:, -1, 0].float())
    g = torch.cat(g)
    g = g[~torch.isnan(g)]
    return float(torch.quantile(g.cpu(), 1.0 - rate).clamp(1e-6, 1 - 1e-6))


def flops_ratio(cfg, name: str, info: dict, prompt: int, new: int) -> float:
    """Decode FLOPs ÷ Standard (spec accounting) for the realised depth pattern, averaged over rows."""
    std = decode_flops_standard(cfg, prompt, new)
    if name == "standard":
        return 1.0
    if name == "tah2-fixed":
        return decode_flops_fixed(cfg, prompt, new, M) / std
    d, p = info["depths"], info["prompt_depths"]
    return sum(decode_flops_tah2(cfg, d[b].tolist(), p[b].tolist(), M) for b in range(d.shape[0])) / d.shape[0] / std


def measure(models: dict, ids: torch.Tensor, ctx: Ctx, runs: dict) -> dict:
    """One interleaved run of `runs` ({name: (model key, call kwargs)}) on `ids`; per name: tokens/s ÷ Standard,
    decode FLOPs ÷ Standard, mean decode depth, mean depth of the cached tokens and K/V bytes."""
    new = ctx.workload.new
    fns = {name: (lambda key=key, kw=kw: decode(models[key], ids, new, ctx.device, **kw))
           for name, (key, kw) in runs.items()}
    short = ids[:, : min(16, ids.shape[1])]
    warmups = {name: (lambda key=key, kw=kw: decode(models[key], short, 2, ctx.device, **kw))
               for name, (key, kw) in runs.items()}
    best = interleaved_best(fns, ctx.workload.repeats, warmups)
    cfg = models["tah2"].config
    out = {}
    for name, (secs, info) in best.items():
        cache = info["cache"]
        token_depth = getattr(cache, "token_depth", None)
        cached = None
        if token_depth is not None:
            cached = (token_depth.float().sum() / (token_depth > 0).sum().clamp(min=1)).item()
        out[name] = {"tps_ratio": best["standard"][0] / secs, "depth": info["depths"].float().mean().item(),
                     "flops_ratio": flops_ratio(cfg, runs[name][0], info, ids.shape[1], new),
                     "cached_depth": cached, "kv_bytes": kv_bytes(cache), "seconds": secs,
                     "tokens_per_s": ids.shape[0] * new / secs}
    return out


def efficiency_row(row_id: str, batch: int, size: str, r: dict, attn: str) -> Row:
    eff = r["tps_ratio"] * r["flops_ratio"]
    return Row(row_id, f"TaH2 decode FLOPs efficiency, batch {batch}", size, "≥ 0.95", eff, judged(eff >= 0.95),
               unit="",
               note=f"tokens/s {r['tps_ratio']:.2f}× × FLOPs {r['flops_ratio']:.2f} at decode depth {r['depth']:.2f}"
                    f"; {attn}", extra=r)


def fixed_row(row_id: str, batch: int, size: str, r: dict) -> Row:
    return Row(row_id, f"TaH2-fixed decode tokens/s ÷ Standard, batch {batch}", size, "≥ 0.48×", r["tps_ratio"],
               judged(r["tps_ratio"] >= 0.48), note=f"FLOPs {r['flops_ratio']:.2f}", extra=r)


def batch1_rows(size: Size, ctx: Ctx, models: dict, attn: str) -> list[Row]:
    ids = random_ids(size.vocab, 1, ctx.workload.prompt, ctx.device)
    tau = calibrate_tau(models["tah2"], ids, ctx.workload.new)
    runs = {"standard": ("standard", {}), "tah2": ("tah2", {}), "tah2-fixed": ("tah2-fixed", {}),
            "tah2-tau": ("tah2", {"exit_threshold": tau})}
    r = measure(models, ids, ctx, runs)
    t = r["tah2-tau"]
    return [efficiency_row("tah2-eff-b1", 1, size.name, r["tah2"], attn),
            fixed_row("tah2-fixed-b1", 1, size.name, r["tah2-fixed"]),
            Row("tah2-depth1.2-b1", "TaH2 decode tokens/s ÷ Standard at mean depth ≈ 1.2, batch 1", size.name,
                "≥ 0.78×", t["tps_ratio"], judged(t["tps_ratio"] >= 0.78),
                note=f"realised decode depth {t['depth']:.2f} (τ = {tau:.3f}: quantile of the decode tokens' g); "
                     f"efficiency {t['tps_ratio'] * t['flops_ratio']:.2f}", extra={**t, "tau": tau})]


def batch8_rows(size: Size, ctx: Ctx, models: dict, attn: str, batch: int = 8) -> list[Row]:
    ids = random_ids(size.vocab, batch, ctx.workload.prompt, ctx.device, seed=1)
    r = measure(models, ids, ctx, {name: (name, {}) for name in models})
    t = r["tah2"]
    kv = t["kv_bytes"] / r["standard"]["kv_bytes"]
    d = t["cached_depth"] if t["cached_depth"] is not None else t["depth"]
    return [efficiency_row(f"tah2-eff-b{batch}", batch, size.name, t, attn),
            fixed_row(f"tah2-fixed-b{batch}", batch, size.name, r["tah2-fixed"]),
            Row(f"tah2-kv-b{batch}", f"TaH2 KV bytes ÷ Standard, batch {batch}", size.name,
                f"≤ d̄ + 0.05 = {d + 0.05:.2f}", kv, judged(kv <= d + 0.05),
                note=f"d̄ {d:.2f} = mean depth of the cached tokens (prompt + decode); decode depth {t['depth']:.2f}",
                extra={"kv_bytes": t["kv_bytes"], "standard_kv_bytes": r["standard"]["kv_bytes"], "mean_depth": d})]


GROUP_ROWS = {"b1": ("tah2-eff-b1", "tah2-fixed-b1", "tah2-depth1.2-b1"),
              "b8": ("tah2-eff-b8", "tah2-fixed-b8", "tah2-kv-b8")}


def rows(size: Size, ctx: Ctx) -> list[Row]:
    """Every TaH2 decode row of one size (a part whose rows are all filtered out is not run)."""
    parts = {k: v for k, v in GROUP_ROWS.items() if any(ctx.wants(r) for r in v)}
    if not parts:
        return []
    try:
        models, attn = build_models(size, ctx)
    except Exception as exc:
        return [error_row(r, "TaH2 decode", size.name, "", exc) for ids in parts.values() for r in ids]
    out = []
    for part, row_ids in parts.items():
        try:
            out += batch1_rows(size, ctx, models, attn) if part == "b1" else batch8_rows(size, ctx, models, attn)
        except Exception as exc:
            out += [error_row(r, "TaH2 decode", size.name, "", exc) for r in row_ids]
    return [r for r in out if ctx.wants(r.id)]
