"""`hf-loops eval`: evaluate a checkpoint (TaH2, SpiralFormer, SGT or plain Qwen3) on a question/answer dataset.

    hf-loops eval CHECKPOINT [--baseline CHECKPOINT] --dataset FILE_OR_HUB_ID [--split NAME[a:b]]
                  [--max-new-tokens N] [--batch-size B] [--answer-pattern gsm8k|last-number|REGEX] --out DIR

Per model it measures, on the same examples:
- answer NLL and perplexity over the assistant (completion) tokens only, teacher-forced — the tokens TRL's SFT
  trains on (prompt rendered with the chat template and the generation prompt, completion = the rest);
- greedy-generation exact match of the extracted final answer (GSM8K `#### N` by default);
- for models that report per-token depth (TaH2): mean and histogram of the depth that produced every answer token,
  continue rate per iteration, mean depth per token class, the decider's accuracy against lookahead labels, and the
  mean depth of the generated tokens; a plain Qwen3 (what a Standard run saves) is one pass: depth 1 on every token;
- decode FLOPs per generated token from the architecture's FLOPs accounting (`hf_loops.core.flops_*`; the paper's App. A.4 for TaH2 and Qwen3) and
  measured tokens/s.

Batched with left padding; a batch gives the numbers of a per-row loop (tests check it). Outputs (JSON, markdown,
depth map HTML/PNG, depth-by-class and loss-curve PNGs) go to a new directory written atomically.
The same numbers from Python: `hf_loops.evaluation.evaluate(model_or_path, dataset=...)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .core.compat import cache_of
from .core.errors import run_command
from .core.numbers import check_float, check_int
from .core.outdir import atomic_output_dir, check_output_dir
from .core.readers import read_jsonl

# Written into a checkpoint directory by `hf-loops demo` (training time, loss history); `eval` reports it if present.
TRAIN_SUMMARY = "train_summary.json"
DEFAULT_MAX_NEW_TOKENS = 192
DEFAULT_BATCH_SIZE = 10
ANSWER_PATTERNS = {
    "gsm8k": r"####\s*\$?\s*([-+]?[\d,]*\.?\d+)",
    "last-number": r"([-+]?\d[\d,]*\.?\d*)(?!.*\d)",
}
DEEP_GROUPS = {"digits/operators": ("digits", "operators"), "words": ("words",)}


# ----------------------------------------------------------------------------------------------------- data
@dataclass
class EvalExample:
    """One question: `prompt` and `completion` as chat messages (lists of dicts) or plain strings, and the
    reference text the gold answer is extracted from."""

    prompt: list | str
    completion: list | str
    reference: str


def parse_split(split: str | None) -> tuple[str, int | None, int | None]:
    """`"train"`, `"test[80:]"`, `"train[:20]"` → (name, start, stop)."""
    if not split:
        return "train", None, None
    m = re.fullmatch(r"\s*([\w.-]+)\s*(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?\s*", split)
    if not m:
        raise ValueError(f"--split must look like NAME or NAME[start:stop], got {split!r}")
    name, a, b = m.groups()
    return name, int(a) if a else None, int(b) if b else None


def _text_field(row: dict, key: str, where: str) -> str:
    """A string field of a row: null, a number or a list is refused (never scored as the text "None")."""
    value = row[key]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: field {key!r} is {kind}; expected a string")
    return value


def _row_to_example(row: dict, where: str) -> EvalExample:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question'+'answer', 'prompt'+'completion' or "
                         f"'messages', got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
            raise ValueError(f"{where}: 'messages' must be a list of chat messages ending with an assistant turn")
        return EvalExample(msgs[:-1], msgs[-1:], str(msgs[-1].get("content", "")))
    if "prompt" in row and "completion" in row:
        comp = row["completion"]
        ref = comp if isinstance(comp, str) else str(comp[-1].get("content", "")) if comp else ""
        return EvalExample(row["prompt"], comp, ref)
    if "question" in row and "answer" in row:
        question, answer = _text_field(row, "question", where), _text_field(row, "answer", where)
        return EvalExample([{"role": "user", "content": question}], [{"role": "assistant", "content": answer}],
                           answer)
    raise ValueError(f"{where}: expected the fields 'question'+'answer', 'prompt'+'completion' or 'messages', "
                     f"got {sorted(row)}")


def looks_like_path(spec: str) -> bool:
    """A local path rather than a Hub id (`owner/name`)."""
    return spec.startswith(("/", ".", "~")) or spec.endswith((".json", ".jsonl")) or spec.count("/") > 1


def load_examples(spec: str, split: str | None = None) -> list[EvalExample]:
    """Examples from a local .jsonl/.json file or a Hub dataset id (`split` = NAME or NAME[start:stop])."""
    name, start, stop = parse_split(split)
    if looks_like_path(spec) and not os.path.lexists(spec):
        raise ValueError(f"--dataset {spec!r}: no such file")
    if os.path.isfile(spec) or os.path.islink(spec):  # a symlink loop is the file's problem, not the Hub's
        rows, lines = read_jsonl(spec, "--dataset")
        where = (lambda i: f"{spec}:{lines[i]}") if lines else (lambda i: f"{spec}, item {i + 1}")
    else:
        try:
            from datasets import load_dataset

            rows = list(load_dataset(spec, split=name))
        except Exception as err:  # datasets raises many connection/offline/missing error types
            raise ValueError(f"--dataset {spec!r} is neither a local file nor a loadable Hub dataset "
                             f"({type(err).__name__}: {err})") from None
        where = lambda i: f"{spec}[{name}], row {i + 1}"  # noqa: E731
    examples = [_row_to_example(r, where(i)) for i, r in enumerate(rows)]
    examples = examples[start:stop]
    if not examples:
        raise ValueError(f"--dataset {spec!r} (split {split or name!r}) has no examples")
    return examples


# ----------------------------------------------------------------------------------------------------- answers
def answer_regex(pattern: str) -> re.Pattern:
    """`gsm8k` (`#### N`), `last-number`, or a regular expression whose first group (or whole match) is the answer."""
    text = ANSWER_PATTERNS.get(pattern, pattern)
    try:
        return re.compile(text, re.S)
    except re.error as err:
        raise ValueError(f"--answer-pattern {pattern!r} is not a valid regular expression ({err})") from None


def extract_answer(text: str, pattern: str | re.Pattern = "gsm8k") -> str | None:
    """The normalised final answer in `text` (thousands separators, `$` and a trailing `.` removed), or None."""
    rx = pattern if isinstance(pattern, re.Pattern) else answer_regex(pattern)
    matches = list(rx.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    value = m.group(1) if m.groups() else m.group(0)
    value = value.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        f = float(value)
        return str(int(f)) if f == int(f) and abs(f) < 1e15 else repr(f)
    except ValueError:
        return value


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


# ----------------------------------------------------------------------------------------------------- FLOPs
# ----------------------------------------------------------------------------------------------------- models
def check_checkpoint_path(path: str) -> None:
    """A checkpoint argument is a directory or a Hub id: a file, or a local-looking path that does not exist, is
    refused before anything is loaded."""
    if not os.path.isdir(path) and os.path.exists(path):
        raise ValueError(f"checkpoint {path!r} is a file; expected a model directory or a Hub id")
    if looks_like_path(path) and not os.path.exists(path):
        raise ValueError(f"checkpoint {path!r}: no such directory")


def load_model(path: str, dtype=None):
    """(model, tokenizer) from a local directory or Hub id; hf_loops' architectures are registered on import."""
    import torch
    from transformers import AutoTokenizer

    from .core.loading import check_tokenizer_fits, load_causal_lm

    check_checkpoint_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load checkpoint {path!r}: {str(err).splitlines()[0]}") from None
    model = load_causal_lm(path, dtype or torch.float32)  # refuses a checkpoint that lacks weights, naming them
    check_tokenizer_fits(tokenizer, model.config.vocab_size, f"the tokenizer of {path!r}")
    return model, tokenizer


def run_name(model, path: str | None = None) -> str:
    """The model's display name in tables (the architecture registry's, e.g. "TaH2 (M=2)", "Standard (M=1)"). A Qwen3
    checkpoint that `hf-loops train --arch standard` wrote (its run record says so) is "Standard (M=1)", as the TaH2
    model it was trained as."""
    from .conversion.registry import display_name

    if path and _one_pass(model) and _trained_arch(path) == "standard":
        from types import SimpleNamespace

        from .modeling.configuration_tah2 import TAH2_PRESETS

        return display_name(SimpleNamespace(model_type="tah2", **TAH2_PRESETS["standard"]))
    return display_name(model.config)


def _trained_arch(path: str) -> str | None:
    """The `--arch` of the `hf-loops train` run that wrote checkpoint directory `path` (its run_config.json), or None."""
    from .training.train_tah2 import RUN_CONFIG_FILE

    try:
        with open(os.path.join(path, RUN_CONFIG_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    script = record.get("script") if isinstance(record, dict) else None
    return script.get("arch") if isinstance(script, dict) else None


def _one_pass(model) -> bool:
    """A plain Qwen3 model: no loop, one pass (depth 1) for every token (it reports no `iter_counts`)."""
    return getattr(model.config, "model_type", None) == "qwen3"


def _loop_kwargs(model, max_iterations, exit_threshold, only_supported: bool = False) -> dict:
    """The per-call loop knobs given (None: the checkpoint's own); a knob the model does not take is refused, not
    dropped (an SGT model evaluated "with --max-iterations 3" would otherwise report its own depth's numbers).
    `only_supported`: a baseline's knobs — those it does not take are left out, with a note."""
    import inspect

    from .inference import check_model_loop_knobs

    kw = {k: v for k, v in (("max_iterations", max_iterations), ("exit_threshold", exit_threshold)) if v is not None}
    if only_supported:
        accepted = inspect.signature(model.forward).parameters
        dropped = sorted(k for k in kw if k not in accepted)
        if dropped:
            print(f"note: the {model.config.model_type!r} baseline has no {', '.join(dropped)}; evaluated as is",
                  file=sys.stderr)
        kw = {k: v for k, v in kw.items() if k in accepted}
    check_model_loop_knobs(model, kw)
    return kw


def _progress(iterable, desc: str, enabled: bool, total=None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------- evaluate
def _teacher_forced(model, batch, pad_id, loop_kw):
    """Per row: NLL of every completion token, the depth and continue probabilities of the position predicting it."""
    import torch

    seqs = [p + a for p, a in batch]
    ids, mask = left_pad(seqs, pad_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **loop_kw)
    logits = out.logits
    depths = getattr(out, "iter_counts", None)
    if depths is None and _one_pass(model):
        depths = torch.ones_like(ids)
    probs = getattr(out, "continue_probs", None)
    rows = []
    W = ids.shape[1]
    for i, (_p, a) in enumerate(batch):
        start = W - len(a) - 1  # the position predicting the first completion token
        where = torch.arange(start, W - 1)
        logp = torch.log_softmax(logits[i, where].float(), dim=-1)
        nll = -logp.gather(-1, ids[i, where + 1, None]).squeeze(-1)
        row = {"nll": nll.tolist()}
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
            if _one_pass(model):
                row["generated_depths"] = [1] * n
        rows.append(row)
    return rows


def _decider_counts(model, prompt_ids, answer_ids, loop_kw):
    """(correct, total) decisions per boundary m against lookahead labels on one example (no padding), or None."""
    import torch

    from .training.tah2_trainer import decider_accuracy_counts, label_settings, tah2_joint_loss

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


def _gsm8k_spans(texts: list[str]) -> list[tuple[str, int, int]]:
    joined, start = "", None
    for i, t in enumerate(texts):
        joined += t
        if start is None and "####" in joined:
            start = i
            while start > 0 and "#" in texts[start - 1]:
                start -= 1
            break
    if start is None:
        return [("answer", 0, len(texts))]
    return [("reasoning", 0, start), ("final answer (#### N)", start, len(texts))]


def evaluate(model, tokenizer=None, dataset: str | None = None, examples: Sequence[EvalExample] | None = None,
             split: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, answer_pattern: str = "gsm8k",
             max_iterations: int | None = None, exit_threshold: float | None = None, stop_strings=None,
             decider_accuracy: bool = True, progress: bool = True, name: str | None = None,
             baseline: bool = False) -> dict:
    """Evaluate one model (an instance or a checkpoint path/id) on `examples` or `dataset`; returns a JSON-able dict
    {"name", "model", "metrics", "examples"} (see the module docstring for the metrics). Loop knobs the model does not
    take are refused, unless `baseline` (then they are left out for it)."""
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        model, loaded_tok = load_model(path)
        tokenizer = tokenizer or loaded_tok
    if tokenizer is None:
        raise ValueError("evaluate needs a tokenizer when given a model instance")
    if examples is None:
        if dataset is None:
            raise ValueError("evaluate needs `dataset` or `examples`")
        examples = load_examples(dataset, split)
    if len(examples) == 0:
        raise ValueError("evaluate got no examples: give at least one")
    check_int("batch_size", batch_size, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    model.eval()
    loop_kw = _loop_kwargs(model, max_iterations, exit_threshold, only_supported=baseline)
    M = loop_kw.get("max_iterations", getattr(model.config, "max_iterations", 1))
    label = f"eval {name or run_name(model, path)}"
    tokenized = _tokenize_all(tokenizer, examples)
    records, gen_time, gen_tokens = _run_batches(model, tokenizer, tokenized, batch_size, max_new_tokens, loop_kw,
                                                 stop_strings, label, progress)
    depth_model = "depths" in records[0]
    decisions = (_decider_decisions(model, tokenized, loop_kw, label, progress)
                 if decider_accuracy and depth_model and M >= 2 else {})
    items = _example_items(model, tokenizer, examples, tokenized, records, answer_regex(answer_pattern), M)
    metrics = _summary(items, gen_time, gen_tokens, M, max_new_tokens, batch_size, depth_model, decisions)
    result = {"name": name or run_name(model, path), "model": path, "model_type": model.config.model_type,
              "architecture": type(model).__name__, "dataset": dataset, "split": split,
              "answer_pattern": answer_pattern, "metrics": metrics, "examples": items}
    if path and os.path.isfile(os.path.join(path, TRAIN_SUMMARY)):
        with open(os.path.join(path, TRAIN_SUMMARY), encoding="utf-8") as f:
            result["training"] = json.load(f)
    return result


def _tokenize_all(tokenizer, examples) -> list:
    tokenized = [tokenize_example(tokenizer, ex) for ex in examples]
    for k, (p, a) in enumerate(tokenized):
        if not p or not a:
            raise ValueError(f"example {k + 1}: empty {'prompt' if not p else 'completion'} after tokenisation")
    return tokenized


def _run_batches(model, tokenizer, tokenized, batch_size, max_new_tokens, loop_kw, stop_strings, label, progress):
    """Teacher-forced answer NLL/depths and greedy generation, batched with left padding: (records, s, tokens)."""
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(model, tokenizer)
    n = len(tokenized)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    records = [dict(index=k) for k in range(n)]
    gen_time, gen_tokens = 0.0, 0
    with torch.no_grad():
        for b in _progress(batches, f"{label}: answer NLL", progress):
            for k, row in zip(b, _teacher_forced(model, [tokenized[k] for k in b], pad_id, loop_kw), strict=True):
                records[k].update(row)
        for b in _progress(batches, f"{label}: generate", progress):
            t0 = time.perf_counter()
            rows = _generate(model, tokenizer, [tokenized[k][0] for k in b], pad_id, stop_ids, max_new_tokens,
                             loop_kw, stop_strings)
            gen_time += time.perf_counter() - t0
            for k, row in zip(b, rows, strict=True):
                gen_tokens += len(row["ids"])
                records[k]["generated"] = row
    return records, gen_time, gen_tokens


def _decider_decisions(model, tokenized, loop_kw, label, progress) -> dict:
    """{depth m: (decisions matching the lookahead labels, decisions)} over every example."""
    out = {}
    for k in _progress(range(len(tokenized)), f"{label}: decider labels", progress):
        counts = _decider_counts(model, tokenized[k][0], tokenized[k][1], loop_kw)
        if counts is None:
            break
        for m, (c, n) in counts.items():
            old = out.get(m, (0, 0))
            out[m] = (old[0] + c, old[1] + n)
    return out


def _example_items(model, tokenizer, examples, tokenized, records, rx, M) -> list[dict]:
    """One JSON record per example: the answer's NLL (and depths), the generation, its answer and decode FLOPs (through
    the architecture registry, `hf_loops.analysis.flops`)."""
    from .analysis import flops

    special = set(tokenizer.all_special_ids)
    items = []
    for k, (ex, (_p, a), rec) in enumerate(zip(examples, tokenized, records, strict=True)):
        gen = rec["generated"]
        text = tokenizer.decode(gen["ids"], skip_special_tokens=True)
        pred, gold = extract_answer(text, rx), extract_answer(ex.reference, rx)
        item = {
            "index": k,
            "question": ex.prompt[-1]["content"] if isinstance(ex.prompt, list) else ex.prompt,
            "reference": gold,
            "prediction": pred,
            "correct": pred is not None and pred == gold,
            "generated_text": text,
            "generated_tokens": len(gen["ids"]),
            "answer_tokens": [tokenizer.decode([t]) for t in a],
            "answer_special": [t in special for t in a],
            "answer_nll": rec["nll"],
            "decode_flops": flops(model.config, gen["prompt_streams"], gen["decode_depths"], M),
            "decode_positions": len(gen["decode_depths"]),
        }
        if "depths" in rec:
            item["answer_depths"] = rec["depths"]
            item["answer_continue_probs"] = rec["continue_probs"]
            item["generated_depths"] = gen.get("generated_depths", [])
        items.append(item)
    return items


def _summary(items, gen_time, gen_tokens, M, max_new_tokens, batch_size, depth_model, decisions) -> dict:
    n_tok = sum(len(e["answer_nll"]) for e in items)
    nll = sum(sum(e["answer_nll"]) for e in items) / max(n_tok, 1)
    correct = sum(e["correct"] for e in items)
    decode_positions = sum(e.pop("decode_positions") for e in items)
    flops_total = sum(e["decode_flops"] for e in items)
    metrics = {
        "examples": len(items),
        "answer_tokens": n_tok,
        "answer_nll": nll,
        "perplexity": math.exp(nll) if nll < 700 else float("inf"),
        "exact_match": correct / len(items),
        "correct": correct,
        "generated_tokens": gen_tokens,
        "generation_seconds": gen_time,
        "tokens_per_s": gen_tokens / gen_time if gen_time > 0 else None,
        "decode_positions": decode_positions,
        "decode_flops_per_token": flops_total / decode_positions if decode_positions else None,
        "max_iterations": M,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
    }
    if depth_model:
        metrics.update(depth_metrics(items, M))
        if decisions:
            metrics["decider_accuracy"] = {str(m): c / n if n else None for m, (c, n) in sorted(decisions.items())}
            metrics["decider_decisions"] = {str(m): n for m, (c, n) in sorted(decisions.items())}
    return metrics


def depth_metrics(examples: Sequence[dict], max_iterations: int) -> dict:
    """Mean/histogram of the answer tokens' depths, continue rate per iteration, per-class depth, generated depth."""
    from .analysis.depth_map import class_depth_stats, group_deep_share, merge_class_stats

    depths = [d for e in examples for d in e["answer_depths"]]
    gen = [d for e in examples for d in e.get("generated_depths", [])]
    hist = {str(m): sum(1 for d in depths if d == m) for m in range(1, max_iterations + 1)}
    cont = {}
    for m in range(1, max_iterations):
        ran = [d for d in depths if d >= m]
        cont[str(m)] = sum(1 for d in ran if d > m) / len(ran) if ran else None
    stats = merge_class_stats([  # special tokens (end of turn) are not text: left out of the class means
        class_depth_stats(*zip(*[(t, d) for t, d, s in zip(e["answer_tokens"], e["answer_depths"],
                                                               e["answer_special"], strict=True) if not s], strict=True))
        for e in examples if not all(e["answer_special"])
    ])
    return {
        "mean_depth": sum(depths) / len(depths) if depths else None,
        "depth_histogram": hist,
        "continue_rate": cont,
        "mean_depth_generated": sum(gen) / len(gen) if gen else None,
        "depth_by_class": stats,
        "deep_share": {group: group_deep_share(stats, classes) for group, classes in DEEP_GROUPS.items()},
    }


# ----------------------------------------------------------------------------------------------------- tables
def _fmt(x, spec=".3f", none="–"):
    return none if x is None else format(x, spec)


def comparison_rows(results: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table (baseline = results[0]): answer NLL, exact match, mean depth on the reference answers and
    on the generated tokens, decode FLOPs per token ÷ baseline, training time ÷ baseline, decider accuracy."""
    base = results[0]
    bf = base["metrics"].get("decode_flops_per_token")
    bt = (base.get("training") or {}).get("train_runtime")
    pattern = base.get("answer_pattern", "gsm8k")  # what "exact match" compared (results before it: gsm8k)
    pattern = {"gsm8k": "#### N", "last-number": "last number"}.get(pattern, pattern)
    headers = ["run", "answer NLL", f"exact match ({pattern})", "mean depth", "mean depth (generated)",
               f"decode FLOPs/token ÷ {base['name']}",
               f"training time ÷ {base['name']}", "decider acc."]
    rows = []
    for r in results:
        m = r["metrics"]
        f = m.get("decode_flops_per_token")
        t = (r.get("training") or {}).get("train_runtime")
        acc = m.get("decider_accuracy") or {}
        rows.append([
            r["name"],
            _fmt(m["answer_nll"]),
            f"{m['correct']}/{m['examples']} ({100 * m['exact_match']:.0f}%)",
            _fmt(m.get("mean_depth"), ".3f", "1 (no loop)"),
            _fmt(m.get("mean_depth_generated"), ".3f", "1 (no loop)"),
            f"{f / bf:.3f}×" if f and bf else "–",
            f"{t / bt:.2f}×" if t and bt else "–",
            " ".join(f"{_fmt(v, '.1%')}" for v in acc.values()) if acc else "–",
        ])
    return headers, rows


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def console_table(headers, rows) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def details_markdown(result: dict) -> str:
    """Everything else measured for one model, as markdown."""
    m = result["metrics"]
    lines = [f"### {result['name']}", "", f"- checkpoint: `{result.get('model') or '(in memory)'}` "
             f"({result['architecture']}, model_type `{result['model_type']}`)",
             f"- answer NLL {m['answer_nll']:.4f} nats/token over {m['answer_tokens']} assistant tokens; "
             f"perplexity {m['perplexity']:.2f}",
             f"- exact match {m['correct']}/{m['examples']} ({100 * m['exact_match']:.1f}%), greedy, "
             f"≤ {m['max_new_tokens']} new tokens",
             f"- decode FLOPs per token {_fmt(m['decode_flops_per_token'], '.4g')} over {m['decode_positions']} decode "
             f"positions; {m['generated_tokens']} tokens generated at {_fmt(m['tokens_per_s'], '.1f')} tokens/s "
             f"(batch {m['batch_size']})"]
    if m.get("mean_depth") is not None:
        hist = ", ".join(f"depth {k}: {v}" for k, v in m["depth_histogram"].items())
        cont = ", ".join(f"after depth {k}: {_fmt(v, '.1%')}" for k, v in m["continue_rate"].items()) or "–"
        lines += [f"- mean depth {m['mean_depth']:.3f} on the reference answers (teacher-forced; {hist}); "
                  f"{_fmt(m.get('mean_depth_generated'), '.3f')} on the generated tokens",
                  f"- continue rate {cont}"]
        if m.get("decider_accuracy"):
            acc = ", ".join(f"boundary {k}: {_fmt(v, '.1%')} of {m['decider_decisions'][k]} decisions"
                            for k, v in m["decider_accuracy"].items())
            lines.append(f"- decider accuracy against lookahead labels (per example, ρ = 0.99): {acc}")
        ds = m["deep_share"]
        lines.append("- share of deep tokens (depth ≥ 2): " + ", ".join(
            f"{g} {_fmt(v, '.1%')}" for g, v in ds.items()))
        lines += ["", "| token class | tokens | mean depth | deep share |", "|---|---|---|---|"]
        for c, s in m["depth_by_class"].items():
            lines.append(f"| {c} | {s['tokens']} | {_fmt(s['mean_depth'])} | {_fmt(s['deep_share'], '.1%')} |")
    if result.get("training"):
        t = result["training"]
        lines.append("")
        lines.append(f"- training: {t.get('steps')} steps in {_fmt(t.get('train_runtime'), '.1f')} s"
                     + (f"; final decider accuracy (train) {_fmt(t.get('decider_acc'), '.1%')}"
                        if t.get("decider_acc") is not None else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- pictures
def depth_rows(result: dict, limit: int | None = None):
    """Depth-map rows (`hf_loops.analysis.depth_map.DepthMapRow`) of a depth-reporting result's reference answers."""
    from .analysis.depth_map import depth_map

    rows = []
    for e in result["examples"][:limit]:
        q = e["question"].replace("\n", " ")
        label = f"#{e['index'] + 1}: {q[:90]}{'…' if len(q) > 90 else ''}"
        rows.append(depth_map(e["answer_tokens"], e["answer_depths"], e["answer_continue_probs"],
                              special=e["answer_special"], spans=_gsm8k_spans(e["answer_tokens"]), label=label))
    return rows


def plot_loss_curves(runs: dict[str, list[dict]], path: str) -> None:
    """NTP loss and decider loss per step for every run (`runs`: name → Trainer log history)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)
    colors = ["#8fa3bf", "#c44e12", "#4c956c", "#7b2cbf"]
    for k, (name, history) in enumerate(runs.items()):
        steps = [h["step"] for h in history if "ntp_loss" in h or "loss" in h]
        ntp = [h.get("ntp_loss", h.get("loss")) for h in history if "ntp_loss" in h or "loss" in h]
        axes[0].plot(steps, ntp, label=name, color=colors[k % len(colors)], lw=1.4)
        dec = [(h["step"], h["decider_loss"]) for h in history if "decider_loss" in h]
        if dec:
            axes[1].plot([s for s, _ in dec], [v for _, v in dec], label=name, color=colors[k % len(colors)], lw=1.4)
    axes[0].set_title("next-token (NTP) loss per step", fontsize=10)
    axes[1].set_title("decider loss (weighted BCE) per step", fontsize=10)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no run with a learned decider", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_pictures(results: Sequence[dict], out_dir: str, depth_map_examples: int | None = None) -> dict:
    """depth_map.html / .png (the deepest model), depth_by_token_class.png, loss_curves.png (if training logs).
    Returns {file: number of token boxes or None}."""
    from .analysis.depth_map import plot_depth_by_class, render_html, render_png

    written = {}
    with_depth = [r for r in results if r["metrics"].get("mean_depth") is not None]
    if with_depth:
        looped = max(with_depth, key=lambda r: r["metrics"]["max_iterations"])
        M = looped["metrics"]["max_iterations"]
        rows = depth_rows(looped)
        note = (f"{looped['name']} on {len(rows)} held-out reference answers (teacher-forced). Each token is coloured "
                f"by the depth the model spent to predict it; mean depth {looped['metrics']['mean_depth']:.3f}.")
        with open(os.path.join(out_dir, "depth_map.html"), "w", encoding="utf-8") as f:
            f.write(render_html(rows, M, title=f"Per-token depth — {looped['name']}", note=note))
        written["depth_map.html"] = sum(len(r.tokens) for r in rows)
        shown = rows[: depth_map_examples or 4]
        written["depth_map.png"] = render_png(shown, M, os.path.join(out_dir, "depth_map.png"),
                                              title=f"Per-token depth — {looped['name']} (held-out answers)")
        plot_depth_by_class({r["name"]: r["metrics"]["depth_by_class"] for r in with_depth},
                            os.path.join(out_dir, "depth_by_token_class.png"))
        written["depth_by_token_class.png"] = None
    runs = {r["name"]: r["training"]["log_history"] for r in results
            if r.get("training") and r["training"].get("log_history")}
    if runs:
        plot_loss_curves(runs, os.path.join(out_dir, "loss_curves.png"))
        written["loss_curves.png"] = None
    return written


# ----------------------------------------------------------------------------------------------------- output
@contextlib.contextmanager
def output_dir(out: str, overwrite: bool = False, what: str = "--out"):
    """Yield a temporary directory; on success it becomes `out` (one rename, or the old `out` swapped out with
    `overwrite`), on failure it is removed; `out` is locked against a second run meanwhile (`core.outdir`)."""
    with atomic_output_dir(out, what, overwrite=overwrite, label=what) as tmp:
        yield tmp


def write_eval(results: Sequence[dict], out_dir: str, command: str | None = None) -> str:
    """eval.json + eval.md + pictures into `out_dir` (an existing empty directory). Returns the console table."""
    headers, rows = comparison_rows(results)
    with open(os.path.join(out_dir, "eval.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "results": list(results)}, f, indent=1)
    written = write_pictures(results, out_dir)
    md = ["# Evaluation", ""]
    if command:
        md += ["```", command, "```", ""]
    md += [markdown_table(headers, rows), ""]
    md += [details_markdown(r) + "\n" for r in results]
    md += ["Files: eval.json" + "".join(f", {k}" for k in written)]
    with open(os.path.join(out_dir, "eval.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    return console_table(headers, rows)


# ----------------------------------------------------------------------------------------------------- CLI
def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="model directory or Hub id (TaH2, SpiralFormer, SGT or Qwen3)")
    p.add_argument("--baseline", default=None, help="a second checkpoint evaluated the same way; ratios are ÷ it")
    p.add_argument("--dataset", required=True, help="local .jsonl/.json or Hub dataset id (question/answer, "
                                                    "prompt/completion or messages)")
    p.add_argument("--split", default=None, help="NAME or NAME[start:stop] (default: train, all rows)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--answer-pattern", default="gsm8k",
                   help="gsm8k (#### N), last-number, or a regex whose first group is the answer")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="extra stop string (repeatable)")
    p.add_argument("--max-iterations", type=int, default=None, help="TaH2: override M at evaluation")
    p.add_argument("--exit-threshold", type=float, default=None, help="TaH2: override τ at evaluation")
    p.add_argument("--no-decider-accuracy", action="store_true", help="skip the lookahead-label decider check")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: small models decode faster on one thread)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def set_threads(n: int | None) -> None:
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


def cmd_eval(args, argv: Sequence[str] | None = None) -> int:
    import shlex

    set_threads(args.threads)
    check_output_dir(args.out, "--out", overwrite=args.overwrite, hint=" (pass --overwrite to replace it)")
    check_int("--max-new-tokens", args.max_new_tokens, 1)
    check_int("--batch-size", args.batch_size, 1)
    if args.max_iterations is not None:
        check_int("--max-iterations", args.max_iterations, 1)
    if args.exit_threshold is not None:
        check_float("--exit-threshold", args.exit_threshold, 0, 1, low_open=True, high_open=True)
    answer_regex(args.answer_pattern)
    examples = load_examples(args.dataset, args.split)
    for ckpt in [args.checkpoint] + ([args.baseline] if args.baseline else []):
        check_checkpoint_path(ckpt)  # every checkpoint named is checked before the first is evaluated
    with output_dir(args.out, args.overwrite) as tmp:  # refuses a non-empty --out before any work
        results = []
        for i, ckpt in enumerate(([args.baseline] if args.baseline else []) + [args.checkpoint]):
            results.append(evaluate(ckpt, examples=examples, dataset=args.dataset, split=args.split,
                                    batch_size=args.batch_size,
                                    max_new_tokens=args.max_new_tokens, answer_pattern=args.answer_pattern,
                                    max_iterations=args.max_iterations, exit_threshold=args.exit_threshold,
                                    stop_strings=args.stop, decider_accuracy=not args.no_decider_accuracy,
                                    progress=not args.no_progress, baseline=bool(args.baseline) and i == 0))
        command = "hf-loops eval " + shlex.join(list(argv)) if argv is not None else None
        table = write_eval(results, tmp, command=command)
    print(table)
    print(f"wrote {os.path.abspath(args.out)} (eval.json, eval.md, pictures)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-loops eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    return run_command(cmd_eval, args, argv, debug=args.debug)


__all__ = ["EvalExample", "comparison_rows", "evaluate", "extract_answer",
           "load_examples", "load_model", "tokenize_example", "write_eval"]
