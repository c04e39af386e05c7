"""`evaluate`: one model on a list of examples, the per-example records and the summary metrics (answer NLL, exact
match, depth, decode FLOPs, tokens/s); `depth_metrics` for depth-reporting models."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from ..core.numbers import check_int
from .decoding import decider_decisions, run_batches, tokenize_all
from .examples import EvalExample, answer_regex, extract_answer, load_examples
from .models import load_model, loop_kwargs, run_name

# Written into a checkpoint directory by `hf-loops demo` (training time, loss history); `eval` reports it if present.
TRAIN_SUMMARY = "train_summary.json"
DEFAULT_MAX_NEW_TOKENS = 192
DEFAULT_BATCH_SIZE = 10
DEEP_GROUPS = {"digits/operators": ("digits", "operators"), "words": ("words",)}


def evaluate(model, tokenizer=None, dataset: str | None = None, examples: Sequence[EvalExample] | None = None,
             split: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, answer_pattern: str = "gsm8k",
             max_iterations: int | None = None, exit_threshold: float | None = None, stop_strings=None,
             decider_accuracy: bool = True, progress: bool = True, name: str | None = None,
             baseline: bool = False, token_accuracy: bool = False) -> dict:
    """Evaluate one model (an instance or a checkpoint path/id) on `examples` or `dataset`; returns a JSON-able dict
    {"name", "model", "metrics", "examples"} (see the module docstring for the metrics). Loop knobs the model does not
    take are refused, unless `baseline` (then they are left out for it). `token_accuracy`: every example also gets
    "answer_top1", per answer token whether it is the teacher-forced argmax."""
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
    loop_kw = loop_kwargs(model, max_iterations, exit_threshold, only_supported=baseline)
    M = loop_kw.get("max_iterations", getattr(model.config, "max_iterations", 1))
    label = f"eval {name or run_name(model, path)}"
    tokenized = tokenize_all(tokenizer, examples)
    records, gen_time, gen_tokens = run_batches(model, tokenizer, tokenized, batch_size, max_new_tokens, loop_kw,
                                                 stop_strings, label, progress)
    depth_model = "depths" in records[0]
    decisions = (decider_decisions(model, tokenized, loop_kw, label, progress)
                 if decider_accuracy and depth_model and M >= 2 else {})
    items = _example_items(model, tokenizer, examples, tokenized, records, answer_regex(answer_pattern), M,
                           token_accuracy)
    metrics = _summary(items, gen_time, gen_tokens, M, max_new_tokens, batch_size, depth_model, decisions)
    result = {"name": name or run_name(model, path), "model": path, "model_type": model.config.model_type,
              "architecture": type(model).__name__, "dataset": dataset, "split": split,
              "answer_pattern": answer_pattern, "metrics": metrics, "examples": items}
    if path and os.path.isfile(os.path.join(path, TRAIN_SUMMARY)):
        with open(os.path.join(path, TRAIN_SUMMARY), encoding="utf-8") as f:
            result["training"] = json.load(f)
    return result



def _example_items(model, tokenizer, examples, tokenized, records, rx, M, token_accuracy=False) -> list[dict]:
    """One JSON record per example: the answer's NLL (and depths), the generation, its answer and decode FLOPs (through
    the architecture registry, `hf_loops.analysis.flops`)."""
    from ..analysis import flops

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
        if token_accuracy:
            item["answer_top1"] = rec["top1"]
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
    from ..analysis.depth_map import class_depth_stats, group_deep_share, merge_class_stats

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



__all__ = ["DEEP_GROUPS", "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_NEW_TOKENS", "TRAIN_SUMMARY", "depth_metrics", "evaluate"]
