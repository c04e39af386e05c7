"""Every attention backend against eager, for TaH2, SpiralFormer and SGT: one command for a lent GPU (issue 14).

    python -m bench.gpu_check [--device cuda|cpu] [--dtype float32|bfloat16] [--quick]

Small random models built from one Qwen3 config (hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32, vocab 512;
nothing is downloaded). For each architecture and each of sdpa / flex_attention / flash_attention_2, against eager
on the same weights:
  full      a left-padded batch, full forward: max |Δ log-prob| over the real positions (TaH2: and `iter_counts`)
  decode    prefill + 4 cached one-token steps vs eager's full forward (eager's own row is the baseline)
  generate  greedy `generate` with a cache: the number of tokens that differ from eager's (skipped by --quick)
A backend the model refuses with a ValueError is reported "refused: <message>", one whose package is missing
"not installed"; neither is a failure. Tolerance on log-probs: 1e-4 in float32, 3e-2 in bfloat16 and for flash
kernels (they compute in half precision: fp32 inputs are cast down). Token mismatches in generate (and TaH2 depth
flips) under a loose tolerance are reported, not failed. Prints the table, writes
bench/results/<device>-attention[-bfloat16][-quick].json, exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_loops import SGTConfig, SpiralFormerConfig
from hf_loops.conversion import convert_qwen3
from hf_loops.conversion.qwen3_source import cast_model
from hf_loops.modeling.modeling_sgt import SGTForCausalLM
from hf_loops.modeling.modeling_spiralformer import SpiralFormerForCausalLM

BACKENDS = ("sdpa", "flex_attention", "flash_attention_2")
ARCHS = ("tah2", "spiralformer", "sgt")
TIGHT, LOOSE = 1e-4, 3e-2
DECODE_STEPS = 4
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)


# ----------------------------------------------------------------------------------------------------------------------
# models (fp32 on the CPU, seeded; `place` moves and casts)


def build_tah2() -> torch.nn.Module:
    """TaH2 with M = 3 and a decider whose score weights are widened, so depths 1..3 all occur (g far from τ)."""
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval()
    model = convert_qwen3(qwen, "tah2", max_iterations=3, seed=0).eval()
    with torch.no_grad():
        torch.manual_seed(1)
        model.decider.score.weight.normal_(0.0, 3.0)
    return model


def build_spiralformer() -> torch.nn.Module:
    """SpiralFormer-B chunk schedule [8, 4, 2, 1], 1 pre / 2 core / 1 post layers, learned scalings switched on."""
    base = {k: v for k, v in SHAPE.items() if k != "num_hidden_layers"}
    config = SpiralFormerConfig(**base, num_pre_layers=1, num_loop_layers=2, num_post_layers=1,
                                chunk_sizes=[8, 4, 2, 1])
    torch.manual_seed(0)
    model = SpiralFormerForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if any(k in name for k in ("scorers", "allocators", "routers")):
                p.normal_(0.0, 0.5)
    return model


def build_sgt() -> torch.nn.Module:
    """SGT looping heads {0, 3} of layer 1 twice and head 1 of layer 2 once."""
    plan = [{"layer": 1, "heads": [0, 3], "depth": 2}, {"layer": 2, "heads": [1], "depth": 1}]
    torch.manual_seed(0)
    return SGTForCausalLM(SGTConfig(**SHAPE, loop_plan=plan)).eval()


BUILDERS = {"tah2": build_tah2, "spiralformer": build_spiralformer, "sgt": build_sgt}


def place(model, device: str, dtype: torch.dtype):
    model.to(device)
    if dtype != torch.float32:
        cast_model(model, dtype)  # keeps RoPE frequencies in fp32, as from_pretrained does
    model.set_attn_implementation("eager")
    return model


def switch(model, name: str) -> tuple[str, str] | None:
    """Set the backend; None when it took, else (status, full message): "not installed", "refused: <message>" or
    "error: ..." (an unexpected exception: counted as a failure)."""
    try:
        model.set_attn_implementation(name)
    except ImportError as exc:
        return "not installed", str(exc)
    except ValueError as exc:
        return f"refused: {str(exc).splitlines()[0][:70]}…", str(exc)
    except Exception as exc:
        return f"FAIL: {type(exc).__name__} on switching", str(exc)
    if model.config._attn_implementation != name:
        return f"refused: runs {model.config._attn_implementation!r} instead", ""
    return None


# ----------------------------------------------------------------------------------------------------------------------
# the three checks


def left_padded(width: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows of `width`, `width − 5` and `width − 10` real tokens (ids ≥ 3), left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (3, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 10)):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def real_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs().amax(-1) * mask).max())


def full_forward(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False)
    return log_probs(out.logits), getattr(out, "iter_counts", None)


def decode(model, ids, mask) -> torch.Tensor:
    """Prefill all but the last DECODE_STEPS columns, then one cached token at a time (teacher forcing)."""
    n0 = ids.shape[1] - DECODE_STEPS
    with torch.no_grad():
        out = model(ids[:, :n0], attention_mask=mask[:, :n0], use_cache=True)
        logits, cache = [out.logits], out.cache
        for t in range(n0, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
    return log_probs(torch.cat(logits, 1))


def greedy(model, ids, mask, new: int) -> torch.Tensor:
    n0 = ids.shape[1] - DECODE_STEPS
    with torch.no_grad():
        out = model.generate(ids[:, :n0], attention_mask=mask[:, :n0], max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, use_cache=True, pad_token_id=0)
    return out[:, n0:]


# ----------------------------------------------------------------------------------------------------------------------
# one architecture


def row(arch, backend, check, diff, ok, seconds=None) -> dict:
    return {"arch": arch, "backend": backend, "check": check, "diff": diff, "ok": ok, "seconds": seconds}


def value_row(arch, backend, check, diff, tol) -> dict:
    return row(arch, backend, check, diff, "yes" if diff <= tol else "FAIL")


def count_row(arch, backend, check, wrong: int, total: int, loose: bool) -> dict:
    """Mismatched discrete outputs (tokens, depths): exact in a tight run, reported in a loose one."""
    ok = "yes" if wrong == 0 else ("reported" if loose else "FAIL")
    return row(arch, backend, check, f"{wrong}/{total}", ok)


def backend_rows(arch, model, backend, ref, data, args) -> list[dict]:
    """The checks of one backend against the eager reference `ref` (full log-probs, iter_counts, tokens)."""
    ids, mask = data
    loose = args.dtype != "float32" or backend.startswith("flash")
    tol = LOOSE if loose else TIGHT
    rows = []
    if backend != "eager":
        lp, counts = full_forward(model, ids, mask)
        rows.append(value_row(arch, backend, "full", real_diff(lp, ref["lp"], mask), tol))
        if ref["counts"] is not None:
            real = mask.bool()
            wrong = int((counts[real] != ref["counts"][real]).sum())
            rows.append(count_row(arch, backend, "iter_counts", wrong, int(real.sum()), loose))
    rows.append(value_row(arch, backend, "decode", real_diff(decode(model, ids, mask), ref["lp"], mask), tol))
    if not args.quick and backend != "eager":
        tokens = greedy(model, ids, mask, args.new_tokens)
        wrong = int((tokens != ref["tokens"]).sum()) if tokens.shape == ref["tokens"].shape else tokens.numel()
        rows.append(count_row(arch, backend, "generate", wrong, ref["tokens"].numel(), loose))
    return rows


def arch_rows(arch: str, args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    model = place(BUILDERS[arch](), args.device, dtype)
    data = left_padded(args.width, args.device)
    lp, counts = full_forward(model, *data)
    ref = {"lp": lp, "counts": counts, "tokens": None if args.quick else greedy(model, *data, args.new_tokens)}
    if counts is not None:
        depths = sorted(set(counts[data[1].bool()].tolist()))
        eprint(f"[{arch}] eager depths at real positions: {depths}")
    rows = []
    for backend in ("eager", *args.backends):
        start = time.perf_counter()
        model.set_attn_implementation("eager")
        torch._dynamo.reset()  # each flex path compiles afresh (not past a limit another architecture used up)
        why = switch(model, backend) if backend != "eager" else None
        if why is not None:
            rows.append({**row(arch, backend, "-", "-", why[0]), "note": why[1]})
            continue
        try:
            got = backend_rows(arch, model, backend, ref, data, args)
        except Exception as exc:
            got = [{**row(arch, backend, "-", "-", f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0][:70]}"),
                    "note": repr(exc)}]
        seconds = round(time.perf_counter() - start, 1)
        for r in got:
            r["seconds"] = seconds
        rows += got
        eprint(f"[{arch}] {backend}: {seconds} s")
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# report


def eprint(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def fmt(diff) -> str:
    return f"{diff:.2e}" if isinstance(diff, float) else str(diff)


def table(rows: list[dict]) -> str:
    lines = ["| arch | backend | check | max abs diff | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['arch']} | {r['backend']} | {r['check']} | {fmt(r['diff'])} | {r['ok']} |" for r in rows]
    return "\n".join(lines)


def settings(args, argv) -> dict:
    try:
        import flash_attn
        flash = flash_attn.__version__
    except ImportError:
        flash = None
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    return {"command": "python -m bench.gpu_check " + " ".join(argv), "device": args.device, "gpu": gpu,
            "dtype": args.dtype, "quick": args.quick, "torch": torch.__version__,
            "transformers": transformers.__version__, "flash_attn": flash, "shape": SHAPE, "width": args.width,
            "decode_steps": DECODE_STEPS, "new_tokens": None if args.quick else args.new_tokens,
            "tolerance": {"tight": TIGHT, "loose": LOOSE},
            "diff": "full/decode: max |Δ log-prob| at real positions; iter_counts/generate: mismatched/total"}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda | cpu (default cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="skip the generate check")
    p.add_argument("--archs", default=",".join(ARCHS), help=f"comma list of {list(ARCHS)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {list(BACKENDS)}")
    p.add_argument("--width", type=int, default=None, help="batch width in tokens (default 16 on cpu, 40 on cuda)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens of the generate check")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<device>-attention[...].json)")
    args = p.parse_args(argv)
    args.archs = [a for a in args.archs.split(",") if a]
    args.backends = [b for b in args.backends.split(",") if b]
    bad = [a for a in args.archs if a not in ARCHS]
    if bad:
        p.error(f"unknown --archs {bad}")
    args.width = args.width or (16 if args.device == "cpu" else 40)
    if args.width < 11 + DECODE_STEPS:
        p.error("--width must be at least 15 (the shortest row has width − 10 tokens)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    rows = []
    for arch in args.archs:
        rows += arch_rows(arch, args)
    print(table(rows))
    stem = f"{args.device.split(':')[0]}-attention" + ("" if args.dtype == "float32" else f"-{args.dtype}")
    path = args.out or os.path.join(RESULTS, stem + ("-quick" if args.quick else "") + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"settings": settings(args, argv), "rows": rows}, f, indent=1)
    failed = [r for r in rows if str(r["ok"]).startswith("FAIL")]
    eprint(f"wrote {path}; {len(failed)} failed check(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
