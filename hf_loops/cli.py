"""`hf-loops` command line: demo / eval / train / convert / generate / analyze / reproduce / serve / pretrain."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .core.errors import one_line as _one_line  # noqa: F401  (kept: tests and callers import it from here)
from .core.errors import run_command
from .core.outdir import check_output_dir, output_lock


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def cmd_demo(args) -> int:
    from .demo.cli import demo_command as run

    return run(args, getattr(args, "argv", None))


def cmd_convert(args) -> int:
    out = os.fspath(args.out)
    check_output_dir(out, "--out")  # a file, a non-empty or unwritable --out is refused before any work
    with output_lock(out, "--out"):  # a second convert into the same --out is refused while this one runs
        return _convert_into(args, out)


def _convert_into(args, out: str) -> int:
    import torch

    from .conversion import convert_qwen3, export
    from .conversion.checks import check_config_json
    from .conversion.hub import push_folder, resolve_source_dir
    from .conversion.qwen3_source import load_qwen3_source, load_source_tokenizer
    from .conversion.report import conversion_report, format_report
    from .core.loading import check_tokenizer_fits

    overrides = _parse_sets(args.set)
    if args.layer_map is not None:
        overrides["layer_map"] = _parse_value(args.layer_map)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    source_dir = resolve_source_dir(args.source)  # a Hub id is downloaded once, here
    source_config = check_config_json(source_dir)  # a broken config.json is named before anything reads it
    tokenizer = load_source_tokenizer(source_dir, args.tokenizer)
    vocab = source_config.get("vocab_size")
    if tokenizer is not None and isinstance(vocab, int):
        check_tokenizer_fits(tokenizer, vocab, f"--tokenizer {args.tokenizer!r}" if args.tokenizer else "tokenizer")
    model = convert_qwen3(source_dir, args.arch, dtype=dtype, tokenizer=tokenizer, calibration=args.calibration,
                          allow_pickle=args.allow_pickle, seed=args.seed, **overrides)
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
    for key in ("loop_plan", "block_loop_layers"):  # what a calibration chose (SGT), whatever the loop mode
        if getattr(model.config, key, None):
            print(f"{key.replace('_', ' ')}: {json.dumps(getattr(model.config, key))}")
    if args.push_to_hub:
        try:
            push_folder(out, args.push_to_hub, private=args.private)
        except Exception as err:
            raise ValueError(f"wrote {out}, but could not push it to the Hub repo {args.push_to_hub!r} "
                             f"(offline or unreachable? {type(err).__name__})") from err
        print(f"pushed {out} to {args.push_to_hub}{' (private)' if args.private else ''} in one commit")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .conversion.checks import check_config_json, check_safetensors_files, load_tokenizer
    from .core.loading import check_tokenizer_fits, load_causal_lm
    from .inference import check_model_loop_knobs, generate_with_depths

    if not args.prompt.strip():
        raise ValueError("--prompt is empty: give some text to continue")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise ValueError(f"--prompt holds a byte that is not UTF-8 at character {err.start + 1}") from None
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if os.path.isdir(args.model):
        check_config_json(args.model)
        check_safetensors_files(args.model)
    elif os.path.exists(args.model):
        raise ValueError(f"model {args.model!r} is a file; expected a checkpoint directory or a Hub repository id")
    tok = load_tokenizer(args.tokenizer or args.model, "--tokenizer" if args.tokenizer else "model")
    model = load_causal_lm(args.model, torch.float32, "model")  # a checkpoint lacking weights is refused
    check_tokenizer_fits(tok, model.config.vocab_size, "--tokenizer" if args.tokenizer else "the model's tokenizer")
    # Explicit values (0 included) are validated, not dropped; None = the checkpoint's own setting.
    kw = {k: v for k, v in (("max_iterations", args.max_iterations), ("exit_threshold", args.exit_threshold))
          if v is not None}
    check_model_loop_knobs(model, kw)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError(f"--prompt {args.prompt!r} encodes to 0 tokens: give some text to continue")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + args.max_new_tokens > limit:
        raise ValueError(f"--prompt ({ids.shape[1]} tokens) + --max-new-tokens ({args.max_new_tokens}) exceed the "
                         f"model's max_position_embeddings ({limit})")
    trace = generate_with_depths(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id, **kw)
    if args.show_depth and trace.depths is not None:
        for t, d in zip(trace.tokens, trace.depths, strict=True):
            print(f"{d}  {tok.decode([t])!r}")
    elif args.show_depth:
        print(f"note: a {model.config.model_type!r} model does not report per-token depth", file=sys.stderr)
    print(tok.decode(trace.tokens, skip_special_tokens=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-loops", description="Looped transformers for Hugging Face transformers")
    sub = p.add_subparsers(dest="command", required=True)

    from .conversion.registry import ARCHITECTURES
    from .demo.cli import add_demo_arguments

    d = sub.add_parser("demo", help="the main job: post-train the embedded 1-hop base as Standard, TaH2 and "
                                    "TaH2-fixed on the depth-bound hop task over 3 seeds, write demo_out/ "
                                    "(--task both: the arithmetic and GSM8K demos; --random: the walk-through)")
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("eval", help="evaluate checkpoints: answer NLL, exact match, depth, decode FLOPs "
                                    "(see `hf-loops eval --help`)", add_help=False)
    e.set_defaults(func=None)

    c = sub.add_parser("convert", help="convert a Qwen3 checkpoint (or an official TaH2 one) and export it with "
                                       "remote code and a model card")
    c.add_argument("source", help="local checkpoint directory or Hub repository id")
    c.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
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
    c.add_argument("--seed", type=int, default=0,
                   help="seed of the freshly initialised modules (the same seed gives the same model; default 0)")
    c.add_argument("--debug", action="store_true", help="on failure, show the full traceback")
    c.set_defaults(func=cmd_convert)

    t = sub.add_parser("train", help="post-train Qwen3 into TaH2 (see `hf-loops train --help`)", add_help=False)
    t.set_defaults(func=None)
    sub.add_parser("pretrain", help="rebuild the embedded default base (see `hf-loops pretrain --help`)",
                   add_help=False).set_defaults(func=None)
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a checkpoint, through transformers' own "
                                 "server (see `hf-loops serve --help`)", add_help=False).set_defaults(func=None)

    g = sub.add_parser("generate", help="generate from a checkpoint, optionally showing per-token depth")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--max-iterations", type=int, default=None)
    g.add_argument("--exit-threshold", type=float, default=None)
    g.add_argument("--show-depth", action="store_true", help="one line per token with its depth (models that "
                                                                 "report per-token depth, e.g. TaH2)")
    g.add_argument("--debug", action="store_true", help="on failure, show the full traceback")
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("analyze", help="attention / residual / fixed-point / depth probes of a checkpoint: figures, "
                                       "metrics.json and report.md")
    from .analysis.analyze import add_arguments as add_analyze_arguments

    add_analyze_arguments(a)
    a.set_defaults(func=cmd_analyze)

    from .reproduce.cli import add_arguments as add_reproduce_arguments

    r = sub.add_parser("reproduce", help="a paper's headline claim trained and tested at CPU scale over seeds: "
                                         "summary.json, report.md, pictures (spiralformer)")
    add_reproduce_arguments(r)
    r.set_defaults(func=cmd_reproduce)
    return p


def cmd_reproduce(args) -> int:
    from .reproduce.cli import main as reproduce_main

    return reproduce_main(args)


def cmd_analyze(args) -> int:
    from .analysis.analyze import main as analyze_main

    return analyze_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the trainer owns its arguments (any SFTConfig field passes through)
        from .training.train_tah2 import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["eval"]:
        from .evaluation.cli import main as eval_main

        return eval_main(argv[1:])
    if argv[:1] == ["serve"]:  # transformers' server owns the run; its options are in hf_loops.serving.http
        from .serving.http import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["pretrain"]:
        from .training.pretrain_base import cli as pretrain_cli

        return pretrain_cli(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]
    return run_command(args.func, args, debug=getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
