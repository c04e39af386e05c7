"""Train a small SGT (Sparse Growing Transformer) from scratch with the HF Trainer and watch it grow.

    python examples/train_sgt.py --output-dir runs/sgt --max-steps 40 --growth-start 8 --growth-window 8 \
        --compact-vocab --max-chars 20000 --seq-len 32 --batch-size 4 --hidden-size 32

(`--compact-vocab` re-indexes the Qwen3 ids that occur in the text, so a CPU demo does not carry a 151k-row
embedding; on CPU, `OMP_NUM_THREADS=1` is often faster for such tiny models.)

The `SGTGrowthCallback` runs Algorithm 1 after every optimizer step: vanilla until `--growth-start`, then it loops the
2 highest-entropy heads of the deepest high-entropy layer, decays the other heads over `--growth-window` steps, adds
(or deepens) layers deep-to-shallow at each window end, and freezes the structure (phase "fixed"), writing
`config.loop_plan`. The final model is saved to `<output-dir>/final` and reloads with `AutoModelForCausalLM` as a
static sliced graph. Data: the real text corpus in `shared/data/corpus/` tokenised with the Qwen3 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator

from hf_loops import SGTConfig, SGTForCausalLM
from hf_loops.training.sgt_growth import SGTGrowthCallback

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"


class PackedText(torch.utils.data.Dataset):
    """Fixed-length blocks of a token stream (causal LM: labels = input_ids)."""

    def __init__(self, token_ids: list[int], seq_len: int):
        n = len(token_ids) // seq_len
        self.blocks = torch.tensor(token_ids[: n * seq_len]).view(n, seq_len)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def load_corpus(corpus_dir: str | Path, tokenizer, max_chars: int) -> list[int]:
    """The first `max_chars` characters of each corpus file, tokenised and concatenated (EOS between files)."""
    ids: list[int] = []
    for path in sorted(Path(corpus_dir).glob("*.txt")):
        with open(path, encoding="utf-8") as f:
            text = f.read(max_chars)
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    if not ids:
        raise FileNotFoundError(f"no *.txt files in {corpus_dir}")
    return ids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-dir", default=str(DATA / "corpus"))
    p.add_argument("--tokenizer", default=str(DATA / "qwen3-tokenizer"))
    p.add_argument("--output-dir", default="runs/sgt")
    p.add_argument("--max-chars", type=int, default=200_000, help="characters read from each corpus file")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--growth-start", type=int, default=8)
    p.add_argument("--growth-window", type=int, default=8)
    p.add_argument("--growth-top-layers", type=int, default=3)
    p.add_argument("--growth-max-layers", type=int, default=3)
    p.add_argument("--max-loop-depth", type=int, default=1)
    p.add_argument("--heads-per-layer", type=int, default=2)
    p.add_argument("--head-decay", default="linear", choices=["linear", "cosine"])
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0 = no checkpoints)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (restores the growth state)")
    p.add_argument("--compact-vocab", action="store_true",
                   help="re-index the Qwen3 token ids seen in the data densely (tiny CPU runs; the mapping is saved)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, vocab_size: int) -> SGTForCausalLM:
    config = SGTConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads, max_position_embeddings=max(128, args.seq_len),
        tie_word_embeddings=True, growth_start=args.growth_start, growth_window=args.growth_window,
        growth_top_layers=args.growth_top_layers, growth_max_layers=args.growth_max_layers,
        max_loop_depth=args.max_loop_depth, heads_per_layer=args.heads_per_layer, head_decay=args.head_decay,
    )
    torch.manual_seed(args.seed)
    return SGTForCausalLM(config)


def main(argv=None):
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    token_ids = load_corpus(args.corpus_dir, tokenizer, args.max_chars)
    vocab_map = None
    if args.compact_vocab:
        vocab_map = sorted(set(token_ids))  # new id → Qwen3 id
        index = {tok: i for i, tok in enumerate(vocab_map)}
        token_ids = [index[tok] for tok in token_ids]
    dataset = PackedText(token_ids, args.seq_len)
    model = build_model(args, len(vocab_map) if vocab_map else len(tokenizer))
    callback = SGTGrowthCallback(seq_len=args.seq_len)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="constant", weight_decay=0.0,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=[], disable_tqdm=True, seed=args.seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        restore_callback_states_from_checkpoint=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=default_data_collator,
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=args.resume)
    # The Trainer may have replaced the callback with the one restored from the checkpoint.
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SGTGrowthCallback))
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    if vocab_map:
        with open(os.path.join(final, "compact_vocab.json"), "w") as f:
            json.dump(vocab_map, f)  # model id i is Qwen3 token vocab_map[i]
    else:
        tokenizer.save_pretrained(final)
    for event in callback.scheduler.history:
        print("sgt", json.dumps(event))
    print("final loop_plan", json.dumps(model.config.loop_plan))
    return trainer, callback


if __name__ == "__main__":
    main()
