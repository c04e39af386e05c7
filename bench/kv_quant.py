"""Quantized loop cache (hf_loops/modeling/kv_quant.py, docs/quantization.md "Quantized loop cache").

On the embedded base (`hf_loops/data/base`: 4 layers, 2 kv heads of head dim 48, trained weights) converted to TaH2
(M = 2, decider score weights widened as in `bench quant` so depths vary), SpiralFormer and SGT, float32:

- KV bytes ÷ fp32: the cache's stored K/V bytes (codes + fp16 scales + the fp window; TaH2's per-stream metadata,
  SpiralFormer's decode state and token inputs excluded, as in `kv_bytes()` / `cache_bytes()["kv"]`) after a
  prefill of `PROMPT` held-out tokens (GSM8K test text) and one decode step, default window of 32 entries.
- greedy agreement: 8 GSM8K test questions as one left-padded batch, `NEW` greedy tokens with the quantized cache vs
  the fp cache (`generate(cache_implementation="quantized", cache_config={"nbits": n})`, lockstep for TaH2, since
  the scores are returned): the share of rows whose tokens are identical, and of tokens equal; where a row differs,
  the note gives the step and the fp cache's own top-2 logit margin there.

Runs once per invocation (the base does not depend on --sizes). CPU or GPU.
"""

from __future__ import annotations

import torch

from .common import Ctx, Row, Size, error_row, judged

NBITS = (8, 4)
BYTES_GOAL = {8: 0.3}
PROMPT = {False: 2000, True: 256}
NEW = {False: 32, True: 12}
QUESTIONS = 8
_done: set = set()


def _model(arch: str, device: str):
    from .quantized import converted_base_model

    return converted_base_model(arch).to(device).eval()


def _kv_bytes(model, cache) -> int:
    from hf_loops.modeling.kv_quant import cache_kv_bytes

    return cache_kv_bytes(model, cache)


@torch.no_grad()
def _bytes(model, ids, cache) -> int:
    out = model(ids, cache=cache, use_cache=True)
    out = model(ids[:, -1:], cache=out.cache, use_cache=True)
    return _kv_bytes(model, out.cache)


@torch.no_grad()
def _greedy(model, batch, new, cache_config=None):
    """(new tokens, fp top-2 logit margin at every step)."""
    extra = {} if cache_config is None else {"cache_implementation": "quantized", "cache_config": cache_config}
    out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, **extra)
    top2 = torch.stack(out.scores, 1).float().topk(2, -1).values
    return out.sequences[:, -new:], top2[..., 0] - top2[..., 1]


def _divergence(got, ref, margin) -> str:
    """Where rows first differ, with the fp cache's top-2 logit margin there (a near-tie is a small margin)."""
    parts = []
    for r in range(ref.shape[0]):
        differ = (got[r] != ref[r]).nonzero()
        if differ.numel():
            step = int(differ[0])
            parts.append(f"row {r} at token {step + 1} (fp top-2 margin {float(margin[r, step]):.2g})")
    typical = float(margin.median())
    return "; first divergence: " + ", ".join(parts) + f"; median margin {typical:.2g}" if parts else ""


def rows(size: Size, ctx: Ctx) -> list[Row]:
    from transformers import AutoTokenizer, DynamicCache

    from hf_loops.data import default_base_dir, load_gsm8k
    from hf_loops.modeling.loop_utils import quantized_loop_cache

    key = (ctx.quick, ctx.rows, ctx.device)
    if key in _done:
        return []
    _done.add(key)
    tok = AutoTokenizer.from_pretrained(default_base_dir())
    problems = load_gsm8k()
    text = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in problems)
    ids = tok(text, return_tensors="pt").input_ids[:, : PROMPT[ctx.quick]].to(ctx.device)
    tok.padding_side = "left"
    batch = tok([r["question"] for r in problems[:QUESTIONS]], return_tensors="pt", padding=True).to(ctx.device)
    new = NEW[ctx.quick]
    out = []
    for arch in ("tah2", "spiralformer", "sgt"):
        wanted = [nb for nb in NBITS if ctx.wants(f"kvq-{arch}-int{nb}")]
        if not wanted:
            continue
        try:
            model = _model(arch, ctx.device)
            fp_bytes = _bytes(model, ids, DynamicCache(config=model.config))
            ref, margin = _greedy(model, batch, new)
        except Exception as exc:
            out.append(error_row(f"kvq-{arch}", f"{arch} quantized loop cache", "base", "", exc))
            continue
        for nb in wanted:
            rid = f"kvq-{arch}-int{nb}"
            name = f"{arch} int{nb} loop cache KV bytes ÷ fp32"
            goal = f"≤ {BYTES_GOAL[nb]}× (greedy agreement: note)" if nb in BYTES_GOAL else "reported"
            try:
                ratio = _bytes(model, ids, quantized_loop_cache(model, nbits=nb)) / fp_bytes
                got, _ = _greedy(model, batch, new, {"nbits": nb})
                rows_same = (got == ref).all(1).float().mean().item()
                tokens_same = (got == ref).float().mean().item()
                note = (f"{ids.shape[1]}-token prefill, window 32, head dim {model.config.head_dim}; greedy "
                        f"{new} tokens × {QUESTIONS} left-padded GSM8K questions: {rows_same:.0%} of rows identical "
                        f"to the fp cache, {tokens_same:.1%} of tokens equal" + _divergence(got, ref, margin))
                ok = None if nb not in BYTES_GOAL else ratio <= BYTES_GOAL[nb]
                out.append(Row(rid, name, "base", goal, ratio, judged(ok), note=note,
                               extra={"rows_identical": rows_same, "tokens_equal": tokens_same,
                                      "prompt_tokens": ids.shape[1], "new_tokens": new}))
            except Exception as exc:
                out.append(error_row(rid, name, "base", goal, exc))
    return out
