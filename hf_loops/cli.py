"""`hf-loops` command line: demo / convert / generate."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEMO_PROMPT = "Looped transformers think harder on hard tokens."


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


class ByteTokenizer:
    """Bytes as tokens (ids 0..255): lets the demo run with no tokenizer files."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def cmd_demo(args) -> int:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .conversion import convert_qwen3
    from .inference import generate_with_depths

    torch.manual_seed(args.seed)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        vocab = len(tok)
    else:
        tok, vocab = ByteTokenizer(), ByteTokenizer.vocab_size
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    model = convert_qwen3(qwen, "tah2", max_iterations=args.max_iterations, exit_threshold=args.exit_threshold).eval()
    if model.decider is not None:  # an untrained decider sits at g ≈ 0.5; spread it so the demo shows mixed depths
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, 2.0)
    ids = torch.tensor([tok.encode(args.prompt)])
    trace = generate_with_depths(model, ids, max_new_tokens=args.max_new_tokens)
    print(f"tiny random Qwen3 → TaH2 (M={args.max_iterations}, τ={args.exit_threshold}); prompt: {args.prompt!r}")
    print(f"prompt depths: {trace.prompt_depths}")
    print(f"{'step':>4}  {'token':>6}  depth  text")
    for i, (t, d) in enumerate(zip(trace.tokens, trace.depths)):
        print(f"{i:>4}  {t:>6}  {d:>5}  {tok.decode([t])!r}")
    mean = sum(trace.depths) / max(len(trace.depths), 1)
    print(f"mean depth over {len(trace.depths)} generated tokens: {mean:.2f}")
    return 0


def cmd_convert(args) -> int:
    import torch

    from .conversion import (
        conversion_report,
        convert_qwen3,
        export,
        format_report,
        load_qwen3_source,
        load_source_tokenizer,
        push_folder,
        resolve_source_dir,
    )

    overrides = _parse_sets(args.set)
    if args.layer_map is not None:
        overrides["layer_map"] = _parse_value(args.layer_map)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = os.fspath(args.out)
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"--out {out!r} exists and is not empty")
    source_dir = resolve_source_dir(args.source)  # a Hub id is downloaded once, here
    tokenizer = load_source_tokenizer(source_dir, args.tokenizer)
    model = convert_qwen3(source_dir, args.arch, dtype=dtype, tokenizer=tokenizer, calibration=args.calibration,
                          allow_pickle=args.allow_pickle, **overrides)
    report = None
    if not args.no_parity:
        source = load_qwen3_source(source_dir, dtype=dtype)
        report = conversion_report(source, model, tokenizer=tokenizer, source_name=args.source)
        del source
    export(model, out, tokenizer=tokenizer, source=args.source, report=report, license=args.license,
           repo_id=args.push_to_hub)
    if report is not None:
        print(format_report(report, out))
    else:
        n = sum(p.numel() for p in model.parameters())
        print(f"source: {args.source}\nparameters: new {n:,}\n1-loop parity: not measured (--no-parity)\n"
              f"dtype: {str(next(model.parameters()).dtype).replace('torch.', '')}\nwrote {out}")
    if args.arch == "sgt" and getattr(model.config, "loop_plan", None):
        print(f"loop plan: {json.dumps(model.config.loop_plan)}")
    if args.push_to_hub:
        push_folder(out, args.push_to_hub, private=args.private)
        print(f"pushed {out} to {args.push_to_hub}{' (private)' if args.private else ''} in one commit")
    return 0


def cmd_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .inference import generate_with_depths

    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tok(args.prompt, return_tensors="pt").input_ids
    kw = {k: v for k, v in (("max_iterations", args.max_iterations), ("exit_threshold", args.exit_threshold)) if v}
    trace = generate_with_depths(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id, **kw)
    if args.show_depth:
        for t, d in zip(trace.tokens, trace.depths):
            print(f"{d}  {tok.decode([t])!r}")
    print(tok.decode(trace.tokens, skip_special_tokens=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-loops", description="Looped transformers for Hugging Face transformers")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="tiny Qwen3 → TaH2, generate, print each token with its depth")
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--max-iterations", type=int, default=3)
    d.add_argument("--exit-threshold", type=float, default=0.5)
    d.add_argument("--tokenizer", default=None, help="tokenizer directory (default: bytes)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("convert", help="convert a Qwen3 checkpoint (or an official TaH2 one) and export it with "
                                       "remote code and a model card")
    c.add_argument("source", help="local checkpoint directory or Hub repository id")
    c.add_argument("--arch", required=True, choices=["tah2", "spiralformer", "sgt"])
    c.add_argument("--out", required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config field override (JSON values), e.g. max_iterations=3 or chunk_sizes=[4,2,1]")
    c.add_argument("--layer-map", default=None, metavar="JSON",
                   help='spiralformer: source layers per part, e.g. \'{"pre":[0,1],"core":[2,3],"post":[4,5]}\'')
    c.add_argument("--calibration", default=None, metavar="FILE", help="sgt: text file choosing the loop plan")
    c.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the source's)")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    c.add_argument("--allow-pickle", action="store_true",
                   help="official TaH2 import: let the .bin files fall back to full pickle (runs code from them)")
    c.add_argument("--license", default="apache-2.0", help="licence written into the model card")
    c.add_argument("--no-parity", action="store_true", help="skip the 1-loop parity check (loads the source twice)")
    c.add_argument("--push-to-hub", default=None, metavar="REPO", help="push the exported directory in one commit")
    c.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    c.set_defaults(func=cmd_convert)

    t = sub.add_parser("train", help="post-train Qwen3 into TaH2 (see `hf-loops train --help`)", add_help=False)
    t.set_defaults(func=None)

    g = sub.add_parser("generate", help="generate from a checkpoint, optionally showing per-token depth")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--max-iterations", type=int, default=None)
    g.add_argument("--exit-threshold", type=float, default=None)
    g.add_argument("--show-depth", action="store_true")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the trainer owns its arguments (any SFTConfig field passes through)
        from .training.train_tah2 import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
