"""The model passes of `hf-loops eval`: tokenisation as TRL's SFT does it, left padding, the teacher-forced pass (NLL,
per-token depth and continue probabilities of the answer tokens), greedy batched generation (with the executed depth
of every decode position) and the decider's decisions against lookahead labels."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from ..core.compat import cache_of
from .examples import EvalExample
from .models import one_pass


# ----------------------------------------------------------------------------------------------------- tokens
def _chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


def tokenize_example(tokenizer, ex: EvalExample) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) exactly as TRL's SFT tokenises a prompt/completion pair: the completion starts
    where the tokenised prompt (with the generation prompt) and prompt + completion diverge."""
    if isinstance(ex.prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the dataset is conversational but the tokenizer has no chat template")
        prompt = _chat_ids(tokenizer, ex.prompt, True)
        full = _chat_ids(tokenizer, ex.prompt + list(ex.completion), False)
    else:
        prompt = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        completion = ex.completion
        if tokenizer.eos_token and not completion.endswith(tokenizer.eos_token):
            completion = completion + tokenizer.eos_token  # TRL appends EOS to plain completions
        full = tokenizer(ex.prompt + completion, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(prompt), len(full)) and prompt[n] == full[n]:
        n += 1
    return full[:n], full[n:]


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id]:
        if value is not None and value not in ids:
            ids.append(int(value))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None and im_end not in ids:
        ids.append(int(im_end))
    return ids


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int):
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask



def progress_bar(iterable, desc: str, enabled: bool, total=None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)



# ----------------------------------------------------------------------------------------------------- passes
def _teacher_forced(model, batch, pad_id, loop_kw):
    """Per row: NLL of every completion token, whether it is the argmax there (`top1`), the depth and continue
    probabilities of the position predicting it."""
    import torch

    seqs = [p + a for p, a in batch]
    ids, mask = left_pad(seqs, pad_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **loop_kw)
    logits = out.logits
    depths = getattr(out, "iter_counts", None)
    if depths is None and one_pass(model):
        depths = torch.ones_like(ids)
    probs = getattr(out, "continue_probs", None)
    rows = []
    W = ids.shape[1]
    for i, (_p, a) in enumerate(batch):
        start = W - len(a) - 1  # the position predicting the first completion token
        where = torch.arange(start, W - 1)
        logp = torch.log_softmax(logits[i, where].float(), dim=-1)
        nll = -logp.gather(-1, ids[i, where + 1, None]).squeeze(-1)
        row = {"nll": nll.tolist(), "top1": (logp.argmax(-1) == ids[i, where + 1]).tolist()}
        if depths is not None:
            row["depths"] = depths[i, where].tolist()
            if probs is not None and probs.shape[-1] > 0:
                cp = probs[i, where].float()
                row["continue_probs"] = [[None if math.isnan(v) else round(v, 6) for v in r] for r in cp.tolist()]
            else:
                row["continue_probs"] = [[] for _ in range(len(a))]
        rows.append(row)
    return rows


def _generate(model, tokenizer, prompts, pad_id, stop_ids, max_new_tokens, loop_kw, stop_strings):
    """Greedy left-padded batched generation; per row the generated ids (through the first stop token) and, for
    depth-reporting models, the executed depth of every prompt token and of every decode position."""
    ids, mask = left_pad(prompts, pad_id)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, pad_token_id=pad_id,
              eos_token_id=stop_ids, num_beams=1, **loop_kw)
    if stop_strings:
        kw.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    seqs = out.sequences[:, ids.shape[1]:]
    cache = cache_of(out)
    token_depth = getattr(cache, "token_depth", None) if cache is not None else None
    rows = []
    W = ids.shape[1]
    for i, p in enumerate(prompts):
        gen = seqs[i].tolist()
        n = len(gen)
        for j, t in enumerate(gen):
            if t in stop_ids:
                n = j + 1
                break
        gen = gen[:n]
        row = {"ids": gen}
        if token_depth is not None:
            prompt_streams = token_depth[i, W - len(p):W].tolist()
            decode = token_depth[i, W:W + max(n - 1, 0)].tolist()  # positions t = 1..N−1 (the last token is not fed)
            row["prompt_streams"] = prompt_streams
            row["decode_depths"] = decode
            row["generated_depths"] = [prompt_streams[-1]] + decode  # depth that produced each generated token
        else:
            row["prompt_streams"] = [1] * len(p)
            row["decode_depths"] = [1] * max(n - 1, 0)
            if one_pass(model):
                row["generated_depths"] = [1] * n
        rows.append(row)
    return rows


def _decider_counts(model, prompt_ids, answer_ids, loop_kw):
    """(correct, total) decisions per boundary m against lookahead labels on one example (no padding), or None."""
    import torch

    from ..training.tah2_trainer import decider_accuracy_counts, label_settings, tah2_joint_loss

    cfg = model.config
    M = loop_kw.get("max_iterations", cfg.max_iterations)
    if getattr(cfg, "decider", "") != "learned" or M < 2:
        return None
    args = label_settings()  # the training defaults, not a copy of them
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[:, :len(prompt_ids)] = -100
    with torch.no_grad():
        _, outputs, _ = tah2_joint_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                "labels": labels}, args)
    labels_d = getattr(outputs, "depth_labels", None)
    rec = getattr(outputs, "loop_records", None)
    if labels_d is None or rec is None:
        return None
    counts = decider_accuracy_counts(rec.decider_logits, labels_d, loop_kw.get("exit_threshold", cfg.exit_threshold),
                                     M)
    return {m: (int(correct), int(total)) for m, (correct, total) in counts.items()}



def tokenize_all(tokenizer, examples) -> list:
    tokenized = [tokenize_example(tokenizer, ex) for ex in examples]
    for k, (p, a) in enumerate(tokenized):
        if not p or not a:
            raise ValueError(f"example {k + 1}: empty {'prompt' if not p else 'completion'} after tokenisation")
    return tokenized


def run_batches(model, tokenizer, tokenized, batch_size, max_new_tokens, loop_kw, stop_strings, label, progress):
    """Teacher-forced answer NLL/depths and greedy generation, batched with left padding: (records, s, tokens)."""
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(model, tokenizer)
    n = len(tokenized)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    records = [dict(index=k) for k in range(n)]
    gen_time, gen_tokens = 0.0, 0
    with torch.no_grad():
        for b in progress_bar(batches, f"{label}: answer NLL", progress):
            for k, row in zip(b, _teacher_forced(model, [tokenized[k] for k in b], pad_id, loop_kw), strict=True):
                records[k].update(row)
        for b in progress_bar(batches, f"{label}: generate", progress):
            t0 = time.perf_counter()
            rows = _generate(model, tokenizer, [tokenized[k][0] for k in b], pad_id, stop_ids, max_new_tokens,
                             loop_kw, stop_strings)
            gen_time += time.perf_counter() - t0
            for k, row in zip(b, rows, strict=True):
                gen_tokens += len(row["ids"])
                records[k]["generated"] = row
    return records, gen_time, gen_tokens


def decider_decisions(model, tokenized, loop_kw, label, progress) -> dict:
    """{depth m: (decisions matching the lookahead labels, decisions)} over every example."""
    out = {}
    for k in progress_bar(range(len(tokenized)), f"{label}: decider labels", progress):
        counts = _decider_counts(model, tokenized[k][0], tokenized[k][1], loop_kw)
        if counts is None:
            break
        for m, (c, n) in counts.items():
            old = out.get(m, (0, 0))
            out[m] = (old[0] + c, old[1] + n)
    return out



__all__ = ["decider_decisions", "left_pad", "progress_bar", "run_batches", "stop_token_ids", "tokenize_all",
           "tokenize_example"]
