"""Pretrain a small SpiralFormer (or its LoopedFormer baseline) from scratch on plain text with TRL's SFTTrainer.

    python examples/pretrain_spiralformer.py --preset spiral-b --max-steps 200 --output-dir runs/spiral-b
    python examples/pretrain_spiralformer.py --preset looped --max-steps 200 --output-dir runs/looped

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
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = (REPO / ".." / "shared" / "data").resolve()
PRESETS = {"spiral-b": [8, 4, 2, 1], "spiral-l": [16, 8, 4, 2], "looped": [1, 1]}


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
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_dict({"input_ids": train_blocks.tolist()})
    cfg = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine" if args.cosine else "constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_beta2=0.95,
        max_length=args.seq_len,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        dataloader_num_workers=0,
    )
    return SFTTrainer(model=model, args=cfg, train_dataset=dataset, processing_class=tokenizer)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(DATA / "corpus"), help="directory of *.txt files or one text file")
    p.add_argument("--tokenizer", default=str(DATA / "qwen3-tokenizer"))
    p.add_argument("--output-dir", default="runs/spiralformer")
    p.add_argument("--preset", default="spiral-b", choices=sorted(PRESETS))
    p.add_argument("--topology", default="mesh", choices=["mesh", "anchor"])
    p.add_argument("--max-chars", type=int, default=300_000, help="characters read from each corpus file")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cosine", action="store_true", help="cosine schedule (default: constant)")
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
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    args = parse_args(argv)
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
    initial = heldout_loss(model, eval_blocks, args.batch_size)
    trainer = build_trainer(model, train_blocks, tokenizer, args)
    if vocab_map is not None:  # the trainer copies the tokenizer's special ids; map them into the compact vocabulary
        index = {tok: i for i, tok in enumerate(vocab_map)}
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            tok = getattr(tokenizer, name, None)
            for cfg in (model.config, model.generation_config):
                setattr(cfg, name, index.get(tok) if tok is not None else None)
    trainer.train()
    final = heldout_loss(model, eval_blocks, args.batch_size)
    train_losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result = {
        "preset": args.preset,
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
