"""Quantized looped models (weight-only int8 / int4 through `TorchAoConfig`, `hf_loops.core.quantization`).

Quality, per architecture and scheme, on the embedded base (`hf_loops/data/base`, 3M parameters, tied head) converted
to TaH2 (M = 2, decider score weights widened as in tah2-decode so g spreads over (0, 1)), SpiralFormer and SGT:
held-out NLL on the vendored GSM8K test problems' text (question + answer; not in the base's pretraining corpus) ÷
float32 and ÷ bfloat16, the share of tokens whose executed depth changes (TaH2: with the module policy, and with the
decider and updater quantized too), checkpoint bytes ÷ float32. TaH2 also by GPTQ (`hf_loops.core.calibration`, Hessians
from every executed depth and from depth 1 only, calibrated on the arithmetic task's text) against round-to-nearest.

Speed, TaH2 and SpiralFormer at the 100m size (random weights, saved then loaded through `from_pretrained`):
`generate` greedy tokens/s (32-token prompt + 32 new tokens, prefill included) at batch 1 and 8, int8 / int4 ÷
float32 and ÷ bfloat16, interleaved in one process, best of N with the spread. CPU only.
"""

from __future__ import annotations

import os
import tempfile

import torch

from .common import Ctx, Row, Size, error_row, interleaved_best, judged, qwen3_source, random_ids, spread, timed

SCHEMES = ("int8", "int4")
NLL_GOAL = {"int8": 0.01, "int4": 0.03}
DEPTH_GOAL = 0.97
SPEED_NEW = 32
SPEED_PROMPT = 32


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _heldout_ids(tok, max_tokens: int) -> torch.Tensor:
    from hf_loops.data import load_gsm8k

    text = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in load_gsm8k())
    return tok(text, return_tensors="pt").input_ids[:, :max_tokens]


@torch.no_grad()
def _nll_depths(model, ids: torch.Tensor, window: int = 256):
    """Mean next-token NLL over `ids` in windows of `window` tokens, and the executed depth of every token (None for
    a model without `iter_counts`)."""
    total, count, depths = 0.0, 0, []
    for start in range(0, ids.shape[1] - 1, window):
        chunk = ids[:, start:start + window + 1]
        if chunk.shape[1] < 2:
            break
        out = model(chunk[:, :-1])
        logp = torch.log_softmax(out.logits.float(), -1)
        total += -logp.gather(-1, chunk[:, 1:, None]).sum().item()
        count += chunk.shape[1] - 1
        if getattr(out, "iter_counts", None) is not None:
            depths.append(out.iter_counts.flatten())
    return total / count, (torch.cat(depths) if depths else None)


def converted_base_model(arch: str):
    """The embedded base converted to `arch` in fp32 (TaH2: M = 2, its decider scores drawn wide enough that depths
    mix; seeded)."""
    from hf_loops.conversion import convert_qwen3
    from hf_loops.data import default_base_dir

    if arch == "tah2":
        model = convert_qwen3(default_base_dir(), "tah2", dtype=torch.float32, seed=0, max_iterations=2)
        torch.manual_seed(1)
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, 2.0 / model.config.hidden_size ** 0.5)
    else:
        model = convert_qwen3(default_base_dir(), arch, dtype=torch.float32, seed=0)
    return model


def _converted_base(arch: str, out: str) -> str:
    converted_base_model(arch).save_pretrained(out)
    return out


def _calibration_batches(tok, n_tokens: int, window: int = 256) -> list[dict]:
    """Calibration inputs for GPTQ, disjoint from the held-out text: the seeded arithmetic task's problems
    (`hf_loops.data.arithmetic`, question + answer), in windows of `window` tokens."""
    from hf_loops.data import arithmetic

    text = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in arithmetic.generate(400, seed=7))
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    return [{"input_ids": ids[:, i:i + window]} for i in range(0, ids.shape[1] - 1, window)]


def gptq_rows(ctx: Ctx) -> list[Row]:
    """TaH2 (the same converted base as `quality_rows`) quantized by GPTQ (`hf_loops.core.calibration`) with Hessians
    from every executed depth and from depth 1 only, against round-to-nearest: held-out NLL ÷ fp32 and depth kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_loops.core import calibration
    from hf_loops.core import quantization as Q
    from hf_loops.data import default_base_dir

    tok = AutoTokenizer.from_pretrained(default_base_dir())
    ids = _heldout_ids(tok, 1024 if ctx.quick else 8192)
    calib = _calibration_batches(tok, 512 if ctx.quick else 4096)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = _converted_base("tah2", os.path.join(tmp, "fp32"))
        fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref_nll, ref_depth = _nll_depths(fp32, ids)
        group = 64 if fp32.config.hidden_size % 128 else 128
        for scheme in SCHEMES:
            rid = f"quant-tah2-{scheme}-gptq"
            try:
                rtn = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, quantization_config=Q.quantization_config(scheme, path,
                                                                                          group_size=group)).eval()
                res = {"rtn": _nll_depths(rtn, ids)}
                reports = {}
                for it in calibration.ITERATIONS:
                    model, reports[it] = calibration.gptq_quantize(path, calib, scheme, iterations=it,
                                                                   group_size=group)
                    res[it] = _nll_depths(model.eval(), ids)
                calls = reports["all"]["calls_per_pass"]["model.layers.0.mlp.up_proj"]
                out = {k: {"nll_ratio": nll / ref_nll, "depth_kept": (d == ref_depth).float().mean().item()}
                       for k, (nll, d) in res.items()}
                best = out["all"]
                ok = abs(best["nll_ratio"] - 1) <= NLL_GOAL[scheme] and best["depth_kept"] >= DEPTH_GOAL
                note = "; ".join(f"{k}: NLL {v['nll_ratio'] - 1:+.2%}, depth kept {v['depth_kept']:.1%}"
                                 for k, v in (("round-to-nearest", out["rtn"]), ("GPTQ every depth", out["all"]),
                                              ("GPTQ depth 1 only", out["first"])))
                note += (f"; {sum(b['input_ids'].numel() for b in calib)} calibration tokens (arithmetic task), "
                         f"the shared linears called {calls:.0f}× per pass; {ids.shape[1]} held-out tokens")
                rows.append(Row(rid, f"tah2 {scheme} GPTQ (every depth) NLL ÷ fp32", "base",
                                f"|ΔNLL| ≤ {NLL_GOAL[scheme]:.0%}, depth kept ≥ {DEPTH_GOAL:.0%}", best["nll_ratio"],
                                judged(ok), note=note, extra=out))
            except Exception as exc:
                rows.append(error_row(rid, f"tah2 {scheme} GPTQ NLL ÷ fp32", "base", "", exc))
    return rows


def quality_rows(ctx: Ctx) -> list[Row]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_loops.core import quantization as Q
    from hf_loops.data import default_base_dir

    tok = AutoTokenizer.from_pretrained(default_base_dir())
    ids = _heldout_ids(tok, 1024 if ctx.quick else 8192)
    rows = []
    for arch in ("tah2", "spiralformer", "sgt"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = _converted_base(arch, os.path.join(tmp, "fp32"))
                fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
                ref_nll, ref_depth = _nll_depths(fp32, ids)
                bf16_nll, _ = _nll_depths(bf16, ids)
                group = 64 if fp32.config.hidden_size % 128 else 128
            except Exception as exc:
                rows.append(error_row(f"quant-{arch}-nll", f"{arch} quantized NLL", "base", "", exc))
                continue
            for scheme in SCHEMES:
                rid = f"quant-{arch}-{scheme}-nll"
                try:
                    variants = {"policy": True} if arch != "tah2" else {"policy": True, "all": False}
                    res = {}
                    for name, keep in variants.items():
                        cfg = Q.quantization_config(scheme, path, group_size=group, keep_loop_control=keep)
                        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                     quantization_config=cfg).eval()
                        res[name] = _nll_depths(model, ids)
                        if name == "policy":
                            qdir = os.path.join(tmp, scheme)
                            model.save_pretrained(qdir)
                            ratio_bytes = _dir_bytes(qdir) / _dir_bytes(path)
                    nll, depth = res["policy"]
                    rel = nll / ref_nll - 1.0
                    note = (f"NLL {nll:.4f} vs fp32 {ref_nll:.4f} ({rel:+.2%}), bf16 {bf16_nll:.4f} "
                            f"({nll / bf16_nll - 1:+.2%}); {ids.shape[1]} tokens; checkpoint {ratio_bytes:.3f}× fp32 "
                            f"(tied embeddings stay fp32)")
                    extra = {"nll": nll, "nll_fp32": ref_nll, "nll_bf16": bf16_nll, "checkpoint_ratio": ratio_bytes}
                    ok = abs(rel) <= NLL_GOAL[scheme]
                    if depth is not None:
                        kept = (depth == ref_depth).float().mean().item()
                        kept_all = (res["all"][1] == ref_depth).float().mean().item()
                        note += (f"; depth kept on {kept:.1%} of tokens (decider+updater quantized too: "
                                 f"{kept_all:.1%}); mean depth {depth.float().mean():.3f} vs fp32 "
                                 f"{ref_depth.float().mean():.3f}")
                        extra.update(depth_kept=kept, depth_kept_all_quantized=kept_all)
                        ok = ok and kept >= DEPTH_GOAL
                    goal = f"|ΔNLL| ≤ {NLL_GOAL[scheme]:.0%}" + (f", depth kept ≥ {DEPTH_GOAL:.0%}" if depth is not None
                                                               else "")
                    rows.append(Row(rid, f"{arch} {scheme} NLL ÷ fp32", "base", goal, nll / ref_nll, judged(ok),
                                    note=note, extra=extra))
                except Exception as exc:
                    rows.append(error_row(rid, f"{arch} {scheme} NLL ÷ fp32", "base", "", exc))
    return rows


def _speed_model(arch: str, size: Size, out: str) -> str:
    from hf_loops.conversion import convert_qwen3

    qwen = qwen3_source(size)
    if arch == "tah2":
        model = convert_qwen3(qwen, "tah2", seed=0, max_iterations=2)
        torch.manual_seed(1)
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, 2.0 / size.hidden ** 0.5)
    else:
        model = convert_qwen3(qwen, arch, seed=0)
    model.save_pretrained(out)
    return out


def speed_rows(size: Size, ctx: Ctx) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from hf_loops.core import quantization as Q

    rows = []
    new = 6 if ctx.quick else SPEED_NEW
    for arch in ("tah2", "spiralformer"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = _speed_model(arch, size, os.path.join(tmp, "fp32"))
                models = {"fp32": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          "bf16": AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)}
                for scheme in SCHEMES:
                    models[scheme] = AutoModelForCausalLM.from_pretrained(
                        path, dtype=torch.float32, quantization_config=Q.quantization_config(scheme, path))
                for m in models.values():
                    m.eval()
            except Exception as exc:
                rows.append(error_row(f"quant-{arch}-speed", f"{arch} quantized decode", size.name, "", exc))
                continue
            for batch in (1, 8):
                ids = random_ids(size.vocab, batch, SPEED_PROMPT, "cpu")

                def gen(m, n=new, ids=ids):
                    with torch.no_grad():
                        return timed("cpu", lambda: m.generate(ids, attention_mask=torch.ones_like(ids),
                                                               max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                               pad_token_id=0))

                secs: dict[str, list[float]] = {}
                best = interleaved_best({k: (lambda m=m: gen(m)) for k, m in models.items()}, ctx.workload.repeats,
                                        warmups={k: (lambda m=m: gen(m, 2)) for k, m in models.items()},
                                        all_seconds=secs)
                tps = {k: batch * new / v[0] for k, v in best.items()}
                agree = {k: (best[k][1] == best["fp32"][1]).float().mean().item() for k in SCHEMES}
                spreads = ", ".join(f"{k} {spread(v):.0%}" for k, v in secs.items())
                for scheme in SCHEMES:
                    r32, r16 = tps[scheme] / tps["fp32"], tps[scheme] / tps["bf16"]
                    goal = "≥ 1.8× fp32 and ≥ 1.0× bf16" if (arch, scheme, batch, size.name) == ("tah2", "int8", 1, "100m") else ""
                    ok = (r32 >= 1.8 and r16 >= 1.0) if goal else None
                    rows.append(Row(
                        f"quant-{arch}-{scheme}-b{batch}", f"{arch} {scheme} generate tokens/s ÷ fp32, batch {batch}",
                        size.name, goal or "reported", r32, judged(ok),
                        note=(f"÷ bf16 {r16:.2f}×; tokens/s fp32 {tps['fp32']:.1f}, bf16 {tps['bf16']:.1f}, "
                              f"{scheme} {tps[scheme]:.1f}; greedy tokens equal to fp32's: {agree[scheme]:.0%} "
                              f"(random weights: near-ties); spread {spreads}"),
                        extra={"tokens_per_s": tps, "seconds": secs}))
    return rows


def rows(size: Size, ctx: Ctx) -> list[Row]:
    """The quality rows (on the embedded base, whatever the size) and the speed rows at `size`."""
    from hf_loops.core import quantization as Q

    if not any(ctx.wants(r) for r in ("quant-tah2-int8-nll", "quant-tah2-int8-gptq", "quant-tah2-int8-b1")):
        return []
    if ctx.device != "cpu" or not Q.is_available():
        why = "CPU only" if ctx.device != "cpu" else 'torchao is not installed (pip install -e ".[quant]")'
        return [error_row("quant", "quantized looped models", size.name, "", why)]
    out = quality_rows(ctx) if ctx.wants("quant-tah2-int8-nll") else []
    if ctx.wants("quant-tah2-int8-gptq"):
        out += gptq_rows(ctx)
    if ctx.wants("quant-tah2-int8-b1"):
        out += speed_rows(size, ctx)
    return out
