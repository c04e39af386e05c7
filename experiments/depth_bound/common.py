"""Shared pieces of the depth-bound experiments: token ids of the task exactly as the package's chat SFT builds
them, a from-scratch Qwen3 (optionally one layer looped), a training loop with a validation curve, and teacher-forced
scoring per difficulty level.

Teacher-forced exact match (every answer token, the end-of-turn included, is the argmax) equals greedy exact match:
greedy decoding reproduces the answer exactly when every argmax along it is right, and leaves it at the first wrong one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_loops.data import depth_task as D

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def tokenizer():
    """The 64-token character-level tokenizer (`char_tokenizer`), built into out/tokenizer on first use."""
    from char_tokenizer import build
    from transformers import AutoTokenizer

    path = os.path.join(OUT, "tokenizer")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        build(path)
    return AutoTokenizer.from_pretrained(path)


class Encoder:
    """Ids of a problem's prompt and answer as `apply_chat_template` gives them (checked on the first problems):
    the embedded tokenizer splits digits one by one, so the ids are built piece by piece, fast."""

    def __init__(self, tok):
        self.tok = tok
        self.prompt_head = tok.apply_chat_template([{"role": "user", "content": "0"}], tokenize=False)
        ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.user = ids("<|im_start|>user\n")
        self.mid = ids("<|im_end|>\n<|im_start|>assistant\n")
        self.char = {c: ids(c)[0] for c in "0123456789+="}
        self.line = ids("\n#### ")
        # TRL's conversational prompt/completion supervises everything after the prompt: the end of turn AND the
        # template's newline after it. A base that never learned that newline gives it a ~14-nat depth-2 gain
        # (measured), which then captures the lookahead labels' coverage cutoff.
        self.end = ids("<|im_end|>\n")
        self.eos = self.end[0]

    def encode(self, row: dict) -> tuple[list[int], list[int], list[str]]:
        """(prompt ids, answer ids ending with <|im_end|> and a newline, the difficulty label of each answer id)."""
        q, ans, labels = row["question"], row["answer"], row["labels"]
        head, tail = ans.split("\n#### ")
        prompt = self.user + [self.char[c] for c in q] + self.mid
        answer = [self.char[c] for c in head] + self.line + [self.char[c] for c in tail] + self.end
        n_line = len(self.line)
        lab = labels[:len(head)] + [D.COPY] * n_line + labels[len(head) + len("\n#### "):] + [D.COPY] * len(self.end)
        return prompt, answer, lab

    def check(self, rows) -> None:
        for r in rows:
            p, a, lab = self.encode(r)
            msgs = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
            full = self.tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
            gp = self.tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
            assert list(gp) == p, (gp, p)
            assert list(full)[:len(p) + len(a)] == p + a, (full, p + a)
            assert len(lab) == len(a)


def tensors(enc: Encoder, rows) -> dict:
    """Right-padded (N, T) input ids, loss mask (answer tokens), per-position level index, level names."""
    levels = list(D.DepthTaskSpec(digits=len(rows[0]["question"].split("+")[0])).levels)
    seqs = [enc.encode(r) for r in rows]
    T = max(len(p) + len(a) for p, a, _ in seqs)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)  # position t predicts token t (a target), shifted below
    lev = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (p, a, lab) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p):len(p) + len(a)] = True
        lev[i, len(p):len(p) + len(a)] = torch.tensor([levels.index(x) for x in lab])
    return {"ids": ids, "mask": mask, "level": lev, "levels": levels}


def qwen3(layers: int, hidden: int = 128, heads: int = 4, kv_heads: int = 2, ffn: int = 512, looped: int = 1,
          seed: int = 0):
    """A from-scratch Qwen3ForCausalLM with the embedded tokenizer's vocabulary; `looped` > 1 applies the same
    `layers` stack `looped` times (weight sharing: the hidden state goes straight into the next pass)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    from char_tokenizer import VOCAB_SIZE

    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers * looped, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=128, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=2, pad_token_id=0, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg)
    if looped > 1:
        for k in range(layers, layers * looped):
            model.model.layers[k] = model.model.layers[k % layers]
    return model


def all_logits(model, ids):
    """Next-token logits at every position but the last. A looped TaH2 model (from `tah2_from_scratch`) gives its
    mixture's output; a plain Qwen3 the head on the last hidden state."""
    if hasattr(model.config, "max_iterations"):
        return model(input_ids=ids, use_cache=False).logits[:, :-1]
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    return model.lm_head(h[:, :-1])


def logits_at(model, ids, mask):
    """Logits predicting the masked (answer) tokens only."""
    pred = mask[:, 1:]  # position t-1 predicts token t
    if hasattr(model.config, "max_iterations"):
        return all_logits(model, ids)[pred], ids[:, 1:][pred]
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    return model.lm_head(h[:, :-1][pred]), ids[:, 1:][pred]


def tah2_from_scratch(preset: str, layers: int, iterations: int, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                      ffn: int = 512, seed: int = 0):
    """A from-scratch looped TaH2ForCausalLM with a fixed-depth preset of `TAH2_PRESETS` ("tah2-fixed": deeper
    passes see earlier tokens' depth-1 keys only; "ouro": every token's pass m sees pass m of the others), so the
    depth evidence is measured with the attention pattern the retrofit uses, not only with a plain stacked loop."""
    from char_tokenizer import VOCAB_SIZE

    from hf_loops.modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config
    from hf_loops.modeling.modeling_tah2 import TaH2ForCausalLM

    torch.manual_seed(seed)
    cfg = TaH2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                     max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2,
                     pad_token_id=0, rope_theta=10000.0, max_iterations=iterations, **TAH2_PRESETS[preset])
    return TaH2ForCausalLM(cfg)


@torch.no_grad()
def score(model, data: dict, batch: int = 256) -> dict:
    """Teacher-forced: exact match (all answer tokens right), loss, accuracy per difficulty level."""
    model.eval()
    n = data["ids"].shape[0]
    right_all, nll, ntok = 0, 0.0, 0
    per = {lv: [0, 0] for lv in data["levels"]}
    for i in range(0, n, batch):
        ids, mask, lev = (data[k][i:i + batch] for k in ("ids", "mask", "level"))
        logits = all_logits(model, ids).float()
        tgt = ids[:, 1:]
        m = mask[:, 1:]
        ok = (logits.argmax(-1) == tgt) | ~m
        right_all += int(ok.all(-1).sum())
        nll += float(torch.nn.functional.cross_entropy(logits[m], tgt[m], reduction="sum"))
        ntok += int(m.sum())
        lv = lev[:, 1:]
        for k, name in enumerate(data["levels"]):
            sel = m & (lv == k)
            per[name][0] += int((ok & sel).sum())
            per[name][1] += int(sel.sum())
    model.train()
    return {"exact_match": right_all / n, "loss": nll / ntok,
            "level_accuracy": {k: (c / t if t else None) for k, (c, t) in per.items()},
            "level_tokens": {k: t for k, (_, t) in per.items()}}


def train(model, train_data: dict, val_data: dict, steps: int, lr: float = 2e-3, batch: int = 64,
          warmup: int = 100, eval_every: int = 250, weight_decay: float = 0.01, seed: int = 0, log=print,
          plateau_patience: int | None = None, min_lr_ratio: float = 0.1) -> dict:
    """AdamW, linear warm-up then cosine to `min_lr_ratio`·lr over `steps`; answer-only loss; a validation point
    every `eval_every` steps. `plateau_patience` (evaluations): stop early once validation exact match has not
    improved by 0.5 points for that many evaluations (the curve is reported either way)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        p = (s - warmup) / max(1, steps - warmup)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))

    n = train_data["ids"].shape[0]
    curve, t0, best, since = [], time.perf_counter(), -1.0, 0
    tokens = 0
    model.train()
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            s = score(model, val_data)
            s.update(step=step, seconds=round(time.perf_counter() - t0, 1), train_tokens=tokens)
            curve.append(s)
            log(f"step {step:5d}  val exact {100 * s['exact_match']:5.1f}%  loss {s['loss']:.4f}  "
                + " ".join(f"{k}:{100 * v:.0f}" for k, v in s["level_accuracy"].items() if v is not None)
                + f"  ({s['seconds']:.0f} s)")
            if s["exact_match"] > best + 0.005:
                best, since = s["exact_match"], 0
            else:
                since += 1
            if plateau_patience and since >= plateau_patience or step == steps:
                break
        idx = torch.randint(0, n, (batch,), generator=g)
        ids, mask = train_data["ids"][idx], train_data["mask"][idx]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits, tgt = logits_at(model, ids, mask)
        loss = torch.nn.functional.cross_entropy(logits.float(), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int((ids != 0).sum())
    return {"curve": curve, "steps": curve[-1]["step"], "seconds": curve[-1]["seconds"], "train_tokens": tokens}


def load_data(n_train: int, n_val: int, spec: D.DepthTaskSpec, seed: int = 0):
    tok = tokenizer()
    enc = Encoder(tok)
    tr = D.make_split("train", n_train, seed, spec)
    va = D.make_split("validation", n_val, seed, spec)
    enc.check(tr[:50] + va[:50])
    return tok, tensors(enc, tr), tensors(enc, va)


def dump(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


class CharEncoder(Encoder):
    """`Encoder` for any task written in the character tokenizer's characters: the answer is encoded character by
    character, with one label per character (`row["labels"]`), then <|im_end|> and the newline (copy)."""

    def __init__(self, tok):
        super().__init__(tok)
        self.char = {c: i for c, i in tok.get_vocab().items() if len(c) == 1}

    def encode(self, row: dict) -> tuple[list[int], list[int], list[str]]:
        prompt = self.user + [self.char[c] for c in row["question"]] + self.mid
        answer = [self.char[c] for c in row["answer"]] + self.end
        return prompt, answer, list(row["labels"]) + [D.COPY] * len(self.end)


def tensors_levels(enc, rows, levels) -> dict:
    """`tensors` with the level names given."""
    seqs = [enc.encode(r) for r in rows]
    T = max(len(p) + len(a) for p, a, _ in seqs)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    lev = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (p, a, lab) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p):len(p) + len(a)] = True
        lev[i, len(p):len(p) + len(a)] = torch.tensor([levels.index(x) for x in lab])
    return {"ids": ids, "mask": mask, "level": lev, "levels": list(levels)}
