"""Pretrain a small SpiralFormer (or its LoopedFormer baseline) from scratch on plain text with TRL's SFTTrainer.

    python examples/pretrain_spiralformer.py --preset spiral-b --max-steps 200 --output-dir runs/spiral-b
    python examples/pretrain_spiralformer.py --preset looped --max-steps 200 --output-dir runs/looped
    python examples/pretrain_spiralformer.py --recipe paper --scale 0.125 ...   # 512 tokens × 64 sequences per step

Recipes (spec §3.2 item 10, §13). `--recipe paper`: the paper's pretraining setup — sequence 4096, global batch 512
sequences, AdamW (0.9, 0.95), weight decay 0.01, peak lr 6e-4 with 1% linear warm-up and cosine decay to 10% of the
peak, bf16 where the GPU supports it — with the sequence length and batch multiplied by `--scale` for small machines
(`--micro-batch-size` sets the per-device batch; gradient accumulation makes up the rest). `--recipe cpu` (default):
the same schedule, optimizer and precision rule on CPU-sized runs (512-token sequences, batch 8, lr 3e-3). Explicit
options override either. A sequence too short for the coarsest chunk to see 32 latents draws a warning: the
1/8-resolution loop of SpiralFormer-B at 64 tokens sees 8 latents, and a SpiralFormer-vs-LoopedFormer comparison at
that length cannot show the paper's gains. The result reports the prefill FLOPs against the paper's {1,1}
LoopedFormer of the same split (`hf_loops.core.flops_spiralformer.compare_to_looped`).

Data: every `*.txt` file of `--corpus` (default: the repository's `../shared/data/corpus/`; a single file works too),
tokenised with the Qwen3 tokenizer, concatenated and cut into fixed-length blocks (causal LM: labels = input_ids).
The last `--eval-blocks` blocks are held out; the script reports the held-out loss before and after training.

The whole loop (pre → T resolution steps → post) lives in the base model `SpiralFormerModel`, so TRL's fused LM head
(which runs `model.model` and then `lm_head` chunk-wise, bypassing `SpiralFormerForCausalLM.forward`) computes the
same loss as the model's own forward; the default `compute_loss` is therefore kept.

`--compact-vocab` re-indexes the Qwen3 token ids that occur in the data densely (tiny CPU runs; the mapping is saved
as `compact_vocab.json` next to the model). Presets: `spiral-b` = chunk sizes [8, 4, 2, 1] (the paper's
SpiralFormer-B schedule), `spiral-l` = [16, 8, 4, 2], `looped` = [1, 1] (LoopedFormer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = (REPO / ".." / "shared" / "data").resolve()
PRESETS = {"spiral-b": [8, 4, 2, 1], "spiral-l": [16, 8, 4, 2], "looped": [1, 1]}
MIN_LATENTS = 32  # the coarsest loop should see at least this many chunk latents per sequence
# Recipes: the values an option takes when it is not given. `seq_len` and `batch_size` of "paper" are multiplied by
# --scale. batch_size is the global batch (sequences per optimizer step).
RECIPES = {
    "paper": {"seq_len": 4096, "batch_size": 512, "lr": 6e-4, "warmup_ratio": 0.01, "min_lr_rate": 0.1,
              "schedule": "cosine", "adam_beta2": 0.95, "weight_decay": 0.01, "precision": "bf16-if-supported"},
    "cpu": {"seq_len": 512, "batch_size": 8, "lr": 3e-3, "warmup_ratio": 0.01, "min_lr_rate": 0.1,
            "schedule": "cosine", "adam_beta2": 0.95, "weight_decay": 0.01, "precision": "bf16-if-supported"},
}


def corpus_files(corpus: str | os.PathLike) -> list[Path]:
    path = Path(corpus)
    if not path.is_absolute() and not path.exists():
        path = (REPO / path).resolve()  # relative paths resolve against the repository
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files at {path}")
    return files


def load_token_ids(corpus, tokenizer, max_chars: int) -> list[int]:
    """The first `max_chars` characters of each corpus file, tokenised and joined with EOS."""
    ids: list[int] = []
    for path in corpus_files(corpus):
        with open(path, encoding="utf-8") as f:
            text = f.read(max_chars)
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def make_blocks(token_ids: list[int], seq_len: int) -> torch.Tensor:
    n = len(token_ids) // seq_len
    if n < 2:
        raise ValueError(f"corpus too small for seq_len={seq_len}: {len(token_ids)} tokens")
    return torch.tensor(token_ids[: n * seq_len]).view(n, seq_len)


def resolve_recipe(args) -> None:
    """Fill every option left unset from the recipe (paper values × --scale for the sequence and batch)."""
    recipe = RECIPES[args.recipe]
    scale = args.scale if args.recipe == "paper" else 1.0
    if args.scale <= 0:
        raise ValueError(f"--scale must be > 0, got {args.scale}")
    for name, value in recipe.items():
        if getattr(args, name, None) is None:
            if name in ("seq_len", "batch_size"):
                value = max(1, round(value * scale))
            setattr(args, name, value)
    if args.cosine:  # the old flag: the cosine schedule is now the default
        args.schedule = "cosine"
    if args.micro_batch_size is None:
        args.micro_batch_size = min(args.batch_size, 8) if args.recipe == "paper" else args.batch_size
    args.grad_accum = max(1, math.ceil(args.batch_size / args.micro_batch_size))


def use_bf16(precision: str) -> bool:
    """bf16 where supported: a CUDA device with bf16 (CPU runs stay fp32)."""
    if precision == "fp32":
        return False
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if precision == "bf16" and not supported:
        raise ValueError("--precision bf16 needs a CUDA device with bf16 support")
    return supported


def short_sequence_warning(seq_len: int, chunk_sizes) -> str | None:
    """A warning when the coarsest loop sees fewer than MIN_LATENTS chunk latents per sequence."""
    g = max(chunk_sizes)
    latents = (seq_len + g // 2) // g
    if g > 1 and latents < MIN_LATENTS:
        return (f"warning: --seq-len {seq_len} gives the coarsest loop (chunk {g}) only {latents} latents per "
                f"sequence (< {MIN_LATENTS}); the multi-resolution loops barely see structure at this length, so a "
                f"SpiralFormer-vs-LoopedFormer comparison cannot show the paper's gains (it trains on 4096 tokens). "
                f"Use --seq-len {MIN_LATENTS * g} or more.")
    return None


def build_model(args, vocab_size: int, pad_token_id: int | None):
    from hf_loops import SpiralFormerConfig, SpiralFormerForCausalLM

    n_layers = args.pre_layers + args.loop_layers + args.post_layers
    config = SpiralFormerConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 3 * args.hidden_size,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        num_hidden_layers=n_layers,
        num_pre_layers=args.pre_layers,
        num_loop_layers=args.loop_layers,
        num_post_layers=args.post_layers,
        chunk_sizes=list(PRESETS[args.preset]),
        topology=args.topology,
        max_position_embeddings=max(512, args.seq_len),
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    return SpiralFormerForCausalLM(config)


@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss of the model's own forward on held-out blocks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        x = blocks[i : i + batch_size].to(device)
        out = model(input_ids=x, labels=x, use_cache=False)
        n = x.shape[0] * (x.shape[1] - 1)
        total += out.loss.item() * n
        count += n
    model.train(was_training)
    return total / count


def build_trainer(model, train_blocks: torch.Tensor, tokenizer, args):
    from datasets import Dataset
    from trl import SFTTrainer

    dataset = Dataset.from_dict({"input_ids": train_blocks.tolist()})
    return SFTTrainer(model=model, args=sft_config(args), train_dataset=dataset, processing_class=tokenizer)


def sft_config(args):
    """The trainer settings of the resolved recipe (gradient accumulation makes up the global batch)."""
    from trl import SFTConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    schedule = {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": args.min_lr_rate}} \
        if args.schedule == "cosine" else {"lr_scheduler_type": "constant_with_warmup"}
    cfg = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=max(1, math.ceil(args.batch_size / (args.micro_batch_size * world))),
        learning_rate=args.lr,
        **schedule,
        warmup_steps=args.warmup_ratio,  # a float below 1 is a ratio of the total steps
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        max_length=args.seq_len,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=use_bf16(args.precision),
        gradient_checkpointing=args.gradient_checkpointing,
        dataloader_num_workers=0,
    )
    return cfg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(DATA / "corpus"), help="directory of *.txt files or one text file")
    p.add_argument("--tokenizer", default=str(DATA / "qwen3-tokenizer"))
    p.add_argument("--output-dir", default="runs/spiralformer")
    p.add_argument("--preset", default="spiral-b", choices=sorted(PRESETS))
    p.add_argument("--topology", default="mesh", choices=["mesh", "anchor"])
    p.add_argument("--max-chars", type=int, default=300_000, help="characters read from each corpus file")
    p.add_argument("--recipe", default="cpu", choices=sorted(RECIPES),
                   help="paper: 4096 tokens × 512 sequences (× --scale), lr 6e-4; cpu: 512 × 8, lr 3e-3; both: AdamW "
                        "(0.9, 0.95), wd 0.01, 1%% warm-up, cosine to 10%%, bf16 where supported")
    p.add_argument("--scale", type=float, default=1.0, help="paper recipe: multiply sequence length and batch")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (recipe: 512 cpu, 4096 paper)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch: sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per device per forward")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--schedule", default=None, choices=["cosine", "constant"],
                   help="cosine: decay to --min-lr-rate × peak after the warm-up; constant: flat after it")
    p.add_argument("--warmup-ratio", type=float, default=None)
    p.add_argument("--min-lr-rate", type=float, default=None)
    p.add_argument("--adam-beta2", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--precision", default=None, choices=["bf16-if-supported", "bf16", "fp32"])
    p.add_argument("--cosine", action="store_true", help="(kept for old command lines: cosine is the default)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--pre-layers", type=int, default=1)
    p.add_argument("--loop-layers", type=int, default=2)
    p.add_argument("--post-layers", type=int, default=1)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compact-vocab", action="store_true")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    resolve_recipe(args)
    return args


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    from hf_loops.core.flops_spiralformer import SpiralShape, compare_to_looped

    args = parse_args(argv)
    warning = short_sequence_warning(args.seq_len, PRESETS[args.preset])
    if warning:
        print(warning, file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    token_ids = load_token_ids(args.corpus, tokenizer, args.max_chars)
    vocab_map = None
    pad_id = tokenizer.pad_token_id
    if args.compact_vocab:
        keep = set(token_ids) | {t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None}
        vocab_map = sorted(keep)  # model id i ↔ Qwen3 id vocab_map[i]
        index = {tok: i for i, tok in enumerate(vocab_map)}
        token_ids = [index[t] for t in token_ids]
        pad_id = index.get(tokenizer.pad_token_id)
    blocks = make_blocks(token_ids, args.seq_len)
    n_eval = min(args.eval_blocks, len(blocks) // 2)
    train_blocks, eval_blocks = blocks[:-n_eval], blocks[-n_eval:]
    model = build_model(args, len(vocab_map) if vocab_map else len(tokenizer), pad_id)
    initial = heldout_loss(model, eval_blocks, args.micro_batch_size)
    trainer = build_trainer(model, train_blocks, tokenizer, args)
    if vocab_map is not None:  # the trainer copies the tokenizer's special ids; map them into the compact vocabulary
        index = {tok: i for i, tok in enumerate(vocab_map)}
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            tok = getattr(tokenizer, name, None)
            for cfg in (model.config, model.generation_config):
                setattr(cfg, name, index.get(tok) if tok is not None else None)
    trainer.train()
    final = heldout_loss(model, eval_blocks, args.micro_batch_size)
    train_losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    flops = compare_to_looped(SpiralShape.from_config(model.config), args.seq_len)
    sched = trainer.args.lr_scheduler_type
    result = {
        "preset": args.preset,
        "recipe": args.recipe,
        "seq_len": args.seq_len,
        "global_batch": args.micro_batch_size * trainer.args.gradient_accumulation_steps * trainer.args.world_size,
        "lr_schedule": f"{getattr(sched, 'value', sched)}, warm-up {args.warmup_ratio:g}",
        "bf16": trainer.args.bf16,
        "prefill_flops": flops["flops"],
        "flops_ratio_vs_looped_1_1": flops["ratio_vs_looped_1_1"],
        "chunk_sizes": model.config.chunk_sizes,
        "params": sum(p.numel() for p in model.parameters()),
        "heldout_loss_start": initial,
        "heldout_loss_end": final,
        "uniform_loss": math.log(model.config.vocab_size),
        "train_losses": train_losses,
    }
    if not args.no_save:
        out = os.path.join(args.output_dir, "final")
        trainer.save_model(out)
        if vocab_map is not None:
            with open(os.path.join(out, "compact_vocab.json"), "w") as f:
                json.dump(vocab_map, f)
        else:
            tokenizer.save_pretrained(out)
    print(json.dumps({k: v for k, v in result.items() if k != "train_losses"}))
    return result


if __name__ == "__main__":
    main()
