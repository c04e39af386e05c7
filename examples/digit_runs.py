"""Why do greedy generations of the GSM8K demo run into long digit runs? Measures, for a `hf-loops demo` output:

    OMP_NUM_THREADS=1 python examples/digit_runs.py demo_out

per run (Standard, TaH2 as trained, TaH2 forced to depth 1): the longest digit run of each generation, the share of
generated tokens inside runs of >= 6 digits, generations that hit the token limit and the mean generated depth. The forced-depth-1 rerun separates "the base model loops" from "depth makes it loop".
"""

import json
import os
import re
import sys

from hf_loops.evaluation import evaluate, load_examples, set_threads

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


def main(out):
    set_threads(1)
    with open(os.path.join(out, "eval.json")) as f:
        results = json.load(f)["results"]
    limit = results[0]["metrics"]["max_new_tokens"]
    rows = {r["name"]: stats(r["examples"], limit) | {"mean_depth_generated": r["metrics"].get("mean_depth_generated")}
            for r in results}
    examples = load_examples(os.path.join(out, "data", "heldout.jsonl"))
    shallow = evaluate(os.path.join(out, "tah2"), examples=examples, max_new_tokens=limit, max_iterations=1,
                       progress=False, decider_accuracy=False, name="TaH2 forced to depth 1")
    rows[shallow["name"]] = stats(shallow["examples"], limit) | {"answer_nll": shallow["metrics"]["answer_nll"]}
    for r in results:
        rows[r["name"]]["answer_nll"] = r["metrics"]["answer_nll"]
    for name, row in rows.items():
        print(json.dumps({"run": name, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}}))
    tah = next(r for r in results if r["metrics"].get("mean_depth_generated"))
    print("TaH2 sample:", repr(tah["examples"][0]["generated_text"][:300]))


if __name__ == "__main__":
    main(sys.argv[1])
