"""TaH2 `generate` rows: continuous-depth decoding vs lockstep, side by side, against the FLOPs bound.

Standard and TaH2 (M = 2, random decider, as in `tah2_decode`) share one random Qwen3's weights. Each row calls
`model.generate` (multinomial sampling, HF's default top-k 50, a fixed seed per call: a random model's greedy output
repeats one token, which would make every depth decision the same) and times the decode part only: from the end of the
prefill (`_prefill` returns, device synchronised) to the end of `generate`. TaH2 runs twice, with the default
continuous-depth loop and with `continuous_depth=False` (lockstep), interleaved with Standard in one run.

Efficiency = (tokens/s ÷ Standard) × (decode FLOPs ÷ Standard), FLOPs from `hf_loops.core.flops_tah2` for the
depths each run realised (the FLOPs bound: 1.0 means the time is what the spec's FLOPs count predicts). Prompts are
32 tokens (every call prefills, untimed, and a long prefill at batch 32 takes minutes on a CPU).
"""

from __future__ import annotations

import torch

from hf_loops.core.compat import cache_of
from hf_loops.core.flops_tah2 import decode_flops_standard, decode_flops_tah2

from .common import SIZES, Ctx, Row, Size, error_row, interleaved_best, judged, now, random_ids, spread, sync
from .tah2_decode import M, build_models, calibrate_tau

# The issue's second shape: hidden 768, 6 layers, vocabulary 16k (run next to the 100m size).
ISSUE_SIZE = Size("768x6", hidden=768, layers=6, heads=12, kv_heads=4, head_dim=64, ffn=2048, vocab=16384)
SIZES.setdefault(ISSUE_SIZE.name, ISSUE_SIZE)
GOALS = {("100m", 8): 0.95, ("768x6", 8): 0.90}
PASS_GOALS = {("100m", 8): 0.90, ("768x6", 8): 0.90}  # share of the closed-batch pass bound (tokens/s ratio ÷ bound)
PROMPT = 32  # every generate call prefills (untimed); a 128-token prefill at batch 32 takes minutes on a CPU


@torch.no_grad()
def timed_generate(model, ids: torch.Tensor, new: int, device: str, seed: int, **kw) -> tuple[float, dict]:
    """Seconds of the decode part of one `generate` call, and its depths: per row, the executed depth of every decoded
    input token and of every prompt token."""
    marks = {}
    prefill = model._prefill

    def timed_prefill(*args, **kwargs):
        out = prefill(*args, **kwargs)
        sync(device)
        marks["prompt_depths"] = out.iter_counts.cpu()
        marks["t0"] = now()
        return out

    model._prefill = timed_prefill
    try:
        torch.manual_seed(seed)
        lockstep = kw.get("continuous_depth") is False and model.config.max_iterations > 1
        out = model.generate(ids, max_new_tokens=new, do_sample=True, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=lockstep, **kw)
        sync(device)
        secs = now() - marks["t0"]
    finally:
        del model._prefill
    B, P = ids.shape
    if model.config.max_iterations == 1:
        depths = [[1] * (new - 1)] * B
    elif lockstep:
        depths = cache_of(out).token_depth[:, P:P + new - 1].cpu().tolist()
    else:
        depths = model._last_decode_depths
    steps = getattr(model, "_last_decode_steps", None) if model._last_decode_mode == "continuous_depth" else None
    return secs, {"depths": depths, "prompt_depths": marks["prompt_depths"], "mode": model._last_decode_mode,
                  "steps": steps}


def flops_ratio(cfg, info: dict, prompt: int, new: int) -> float:
    """Decode FLOPs ÷ Standard for the realised depths (tokens 2..new: the first comes from the prefill), row mean."""
    std = decode_flops_standard(cfg, prompt, new - 1)
    rows = range(len(info["depths"]))
    return sum(decode_flops_tah2(cfg, info["depths"][b], info["prompt_depths"][b].tolist(), M)
               for b in rows) / len(rows) / std


def measure(models: dict, ids: torch.Tensor, ctx: Ctx, new: int, runs: dict, repeats: int) -> dict:
    """Interleaved best-of-`repeats` of `runs` ({name: (model key, generate kwargs)})."""
    fns = {name: (lambda key=key, kw=kw: timed_generate(models[key], ids, new, ctx.device, seed=5, **kw))
           for name, (key, kw) in runs.items()}
    short = ids[:, : min(8, ids.shape[1])]
    warm = {name: (lambda key=key, kw=kw: timed_generate(models[key], short, 3, ctx.device, seed=5, **kw))
            for name, (key, kw) in runs.items()}
    seconds: dict[str, list[float]] = {}
    best = interleaved_best(fns, repeats, warm, all_seconds=seconds)
    cfg = models["tah2"].config
    B, P = ids.shape
    out = {}
    for name, (secs, info) in best.items():
        flat = [d for row in info["depths"] for d in row]
        sums = [sum(row) for row in info["depths"]] or [1]
        fr = 1.0 if runs[name][0] == "standard" else flops_ratio(cfg, info, P, new)
        tps = best["standard"][0] / secs
        out[name] = {"tps_ratio": tps, "flops_ratio": fr, "efficiency": tps * fr, "seconds": secs,
                     "depth": sum(flat) / max(len(flat), 1), "tokens_per_s": B * (new - 1) / secs, "mode": info["mode"],
                     "steps": info.get("steps"), "repeat_seconds": seconds[name], "spread": spread(seconds[name]),
                     # mean ÷ largest per-row Σ depth: a step at any batch size costs a weight pass, so where weight
                     # reads dominate, a fixed batch cannot beat this share of the FLOPs bound (rows wait for the deepest)
                     "balance": sum(sums) / len(sums) / max(max(sums), 1),
                     # the closed-batch pass bound: the largest per-row Σ depth passes for new − 1 Standard steps
                     "pass_bound": (new - 1) / max(max(sums), 1)}
        out[name]["pass_efficiency"] = tps / out[name]["pass_bound"]
    return out


def _rows_for_batch(size: Size, ctx: Ctx, models: dict, batch: int) -> list[Row]:
    prompt = min(PROMPT, ctx.workload.prompt)
    new = ctx.workload.new
    ids = random_ids(size.vocab, batch, prompt, ctx.device, seed=batch)
    runs = {"standard": ("standard", {}), "continuous": ("tah2", {"continuous_depth": True}), "lockstep": ("tah2", {"continuous_depth": False})}
    tau = None
    if batch == 1 and ctx.wants("tah2-gen-depth1.2-b1"):
        tau = calibrate_tau(models["tah2"], ids, new)
        runs["continuous-tau"] = ("tah2", {"exit_threshold": tau, "continuous_depth": True})
        runs["lockstep-tau"] = ("tah2", {"exit_threshold": tau, "continuous_depth": False})
    repeats = ctx.workload.repeats if batch < 32 else max(1, ctx.workload.repeats - 1)
    r = measure(models, ids, ctx, new, runs, repeats)
    c, lk = r["continuous"], r["lockstep"]
    goal = GOALS.get((size.name, batch))
    pass_goal = PASS_GOALS.get((size.name, batch))
    out = [Row(f"tah2-gen-eff-b{batch}", f"TaH2 generate FLOPs efficiency, continuous depth, batch {batch}", size.name,
               f"≥ {goal:.2f}" if goal else "reported", c["efficiency"],
               judged(c["efficiency"] >= goal if goal else None), unit="",
               note=f"tokens/s {c['tps_ratio']:.2f}× × FLOPs {c['flops_ratio']:.2f} at decode depth {c['depth']:.2f};"
                    f" lockstep {lk['efficiency']:.2f} ({lk['tps_ratio']:.2f}× at depth {lk['depth']:.2f});"
                    f" continuous ÷ lockstep tokens/s {lk['seconds'] / c['seconds']:.2f}×; {c['steps']} passes, row"
                    f" balance {c['balance']:.2f} (mean ÷ largest per-row Σ depth); spread between repeats: continuous"
                    f" {c['spread']:.0%}, lockstep {lk['spread']:.0%}, Standard {r['standard']['spread']:.0%};"
                    f" prompt {prompt}",
               extra={"continuous": c, "lockstep": lk, "standard": r["standard"]}),
           Row(f"tah2-gen-pass-eff-b{batch}", f"TaH2 generate tokens/s ÷ its closed-batch pass bound, continuous "
               f"depth, batch {batch}", size.name, f"≥ {pass_goal:.2f}" if pass_goal else "reported",
               c["pass_efficiency"], judged(c["pass_efficiency"] >= pass_goal if pass_goal else None), unit="",
               note=f"tokens/s {c['tps_ratio']:.3f}× Standard ÷ pass bound {c['pass_bound']:.3f} (= {new - 1} Standard "
                    f"steps ÷ the largest per-row Σ depth, the passes a fixed batch needs; {c['steps']} passes run); "
                    f"lockstep {lk['pass_efficiency']:.3f}",
               extra={"continuous": c, "lockstep": lk}),
           Row(f"tah2-gen-lockstep-eff-b{batch}", f"TaH2 generate FLOPs efficiency, lockstep, batch {batch}",
               size.name, "reported", lk["efficiency"], "reported", unit="",
               note=f"tokens/s {lk['tps_ratio']:.2f}× × FLOPs {lk['flops_ratio']:.2f} at decode depth {lk['depth']:.2f}",
               extra=lk)]
    if tau is not None:
        t, tl = r["continuous-tau"], r["lockstep-tau"]
        out.append(Row("tah2-gen-depth1.2-b1", "TaH2 generate tokens/s ÷ Standard at depth ≈ 1.2, batch 1, "
                       "continuous depth", size.name, "≥ 0.78×", t["tps_ratio"], judged(t["tps_ratio"] >= 0.78),
                       note=f"realised decode depth {t['depth']:.2f} (τ = {tau:.3f}); efficiency "
                            f"{t['efficiency']:.2f}; lockstep {tl['tps_ratio']:.2f}× at depth {tl['depth']:.2f}",
                       extra={"continuous": t, "lockstep": tl, "tau": tau}))
    return out


ROW_IDS = ("tah2-gen-eff-b1", "tah2-gen-pass-eff-b1", "tah2-gen-lockstep-eff-b1", "tah2-gen-depth1.2-b1",
           "tah2-gen-eff-b8", "tah2-gen-pass-eff-b8", "tah2-gen-lockstep-eff-b8", "tah2-gen-eff-b32",
           "tah2-gen-pass-eff-b32", "tah2-gen-lockstep-eff-b32")


def _rows_at(size: Size, ctx: Ctx) -> list[Row]:
    batches = [b for b in (1, 8, 32) if any(ctx.wants(r) for r in ROW_IDS if r.endswith(f"-b{b}"))]
    if not batches:
        return []
    try:
        models, _ = build_models(size, ctx, fixed=False)
    except Exception as exc:
        return [error_row(r, "TaH2 generate", size.name, "", exc) for r in ROW_IDS]
    out = []
    for batch in batches:
        try:
            out += _rows_for_batch(size, ctx, models, batch)
        except Exception as exc:
            out += [error_row(r, "TaH2 generate", size.name, "", exc) for r in ROW_IDS if r.endswith(f"-b{batch}")]
    return [r for r in out if ctx.wants(r.id)]


def rows(size: Size, ctx: Ctx) -> list[Row]:
    """The generate rows of `size`; the 100m size also runs the issue's hidden-768 / 6-layer / 16k-vocabulary shape."""
    out = _rows_at(size, ctx)
    if size.name == "100m":
        out += _rows_at(ISSUE_SIZE, ctx)
    return out
