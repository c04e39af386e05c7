"""Why do greedy generations of the GSM8K demo run into long digit runs? Measures, for a `hf-loops demo` output:

    OMP_NUM_THREADS=1 python examples/digit_runs.py demo_out

1. Per decoding variant of the same checkpoints (Standard; TaH2 as trained; TaH2 forced to depth 1; TaH2 with every
   token at depth 2; TaH2 reading out only the deepest depth instead of the stopping-weighted mixture): the longest
   digit run of each generation, the share of generated tokens inside runs of >= 6 digits, generations that hit the
   token limit, the mean generated depth.
2. On TaH2's own greedy generations, teacher-forced: at every position where a digit follows a digit, the probability
   of yet another digit under q(1) (depth 1 alone), under the depth-2 distribution q(2) and under the mixture the
   model decodes with, and how often such positions ran at depth 2. If q(2) puts more mass on "another digit" than
   q(1), the deeper pass is what keeps the runs going; if the mixture does not, the read-out is.
"""

import json
import os
import re
import sys

import torch

from hf_loops.evaluation.cli import set_threads
from hf_loops.evaluation.examples import load_examples
from hf_loops.evaluation.metrics import evaluate
from hf_loops.evaluation.models import load_model

RUN = 6  # a digit run this long or longer is a "long run" (GSM8K answers rarely have numbers over 5 digits)


def stats(items, limit):
    longest, in_run, total, hit = [], 0, 0, 0
    for e in items:
        text = e["generated_text"]
        longest.append(max((len(m) for m in re.findall(r"\d+", text)), default=0))
        hit += e["generated_tokens"] >= limit
        total += e["generated_tokens"]
        in_run += sum(len(m) for m in re.findall(rf"\d{{{RUN},}}", text))  # one digit = one token here
    return {"mean_longest_digit_run": sum(longest) / len(longest), "max_digit_run": max(longest),
            "digits_in_long_runs_per_generated_token": in_run / max(total, 1), "hit_token_limit": hit / len(items)}


def variant(path, examples, limit, name, mixture=None, **knobs):
    model, tok = load_model(path)
    if mixture:
        model.config.mixture = mixture
    r = evaluate(model, tok, examples=examples, max_new_tokens=limit, progress=False, decider_accuracy=False,
                 name=name, **knobs)
    return r, stats(r["examples"], limit) | {"answer_nll": r["metrics"]["answer_nll"],
                                             "mean_depth_generated": r["metrics"].get("mean_depth_generated")}


@torch.no_grad()
def digit_after_digit(path, examples, generated):
    """Teacher-forced on the generated texts: P(next is a digit | a digit run so far) under q(1), q(2), the mixture."""
    model, tok = load_model(path)
    digit_ids = torch.tensor([i for t, i in tok.get_vocab().items() if tok.convert_tokens_to_string([t]).isdigit()])
    sums = {"q1": 0.0, "q2": 0.0, "mixture": 0.0, "deep": 0, "n": 0}
    from hf_loops.evaluation.decoding import tokenize_example

    for ex, e in zip(examples, generated, strict=True):
        prompt = tokenize_example(tok, ex)[0]
        gen = tok(e["generated_text"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + gen])
        texts = [tok.decode([t]) for t in gen]
        pos = [len(prompt) + j for j in range(len(gen) - 1) if texts[j].isdigit()]  # position of a digit token
        if not pos:
            continue
        out = {}
        model.config.mixture = "stop_prob"
        o = model(input_ids=ids, use_cache=False)
        out["mixture"], depth = o.logits[0], o.iter_counts[0]
        out["q1"] = model(input_ids=ids, use_cache=False, max_iterations=1).logits[0].float().log_softmax(-1)
        model.config.mixture = "final"
        out["q2"] = model(input_ids=ids, use_cache=False, exit_threshold=1e-6).logits[0]
        for k, lp in out.items():
            sums[k] += lp[pos][:, digit_ids].exp().sum(-1).sum().item()
        sums["deep"] += int((depth[pos] >= 2).sum())
        sums["n"] += len(pos)
    n = max(sums.pop("n"), 1)
    return {"positions": n, **{f"P(digit) {k}" if k != "deep" else "share at depth 2": round(v / n, 4)
                               for k, v in sums.items()}}


def main(out):
    set_threads(1)
    limit = 192  # the demo's GSM8K generation length (eval.json says which, when the demo has finished)
    if os.path.isfile(os.path.join(out, "eval.json")):
        with open(os.path.join(out, "eval.json")) as f:
            limit = json.load(f)["results"][0]["metrics"]["max_new_tokens"]
    examples = load_examples(os.path.join(out, "data", "heldout.jsonl"))
    tah = os.path.join(out, "tah2")
    rows = {}
    _, rows["Standard"] = variant(os.path.join(out, "standard"), examples, limit, "Standard")
    adaptive, rows["TaH2 (as trained)"] = variant(tah, examples, limit, "TaH2")
    _, rows["TaH2 forced to depth 1"] = variant(tah, examples, limit, "depth 1", max_iterations=1)
    _, rows["TaH2, every token at depth 2"] = variant(tah, examples, limit, "depth 2", exit_threshold=1e-6)
    _, rows["TaH2, deepest depth read out (no mixture)"] = variant(tah, examples, limit, "final", mixture="final")
    for name, row in rows.items():
        print(json.dumps({"run": name, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}}))
    print(json.dumps({"teacher-forced on TaH2's generations": digit_after_digit(tah, examples, adaptive["examples"])}))
    print("TaH2 sample:", repr(adaptive["examples"][0]["generated_text"][:300]))


if __name__ == "__main__":
    main(sys.argv[1])
