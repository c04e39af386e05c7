"""Experimental (issue 31): which copy tokens does a TaH2 checkpoint send deep on the hop task? Teacher-forced deep
share of the answer's tokens by their role: the "#### " prefix, the restated hop count k, the restated query letter x
(whose position predicts the result), the result letter (level 1 / 2), the space after a result, the end of turn.

    PYTHONPATH=. python experiments/depth_bound/copy_depth.py CKPT [--n 200] [--split validation]
"""

import argparse
import collections

from hf_loops.data import hop_task
from hf_loops.evaluation.metrics import evaluate
from hf_loops.evaluation.tasks import hop_task_run


def role(i: int, answer: str, labels) -> str:
    if i >= len(answer):
        return "end of turn"
    if i < len("#### "):
        return "#### prefix"
    j = (i - len("#### ")) % 4
    return ["restated k", "restated x", f"result ({labels[i]}-hop)", "space"][j]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--split", default="validation")
    a = p.parse_args()
    run = hop_task_run(a.n, 0, split=a.split)
    rows = run.rows()
    r = evaluate(a.ckpt, examples=run.examples(rows), batch_size=200, max_new_tokens=run.max_new_tokens(),
                 progress=False, decider_accuracy=False, answer_pattern=hop_task.ANSWER_PATTERN, token_accuracy=True)
    deep, tot = collections.Counter(), collections.Counter()
    for e, row in zip(r["examples"], rows, strict=True):
        pos = 0
        for t, d in zip(e["answer_tokens"], e["answer_depths"], strict=True):
            name = role(pos, row["answer"], row["labels"])
            if name in ("restated k", "restated x", "space") and pos < len(row["answer"]):
                # the hop count of this query (the restated k's digit), to see if 2-hop queries pull copies deep
                q = (pos - len("#### ")) // 4
                k = row["answer"][len("#### ") + 4 * q]
                name = f"{name}, {k}-hop query"
            tot[name] += 1
            deep[name] += d >= 2
            pos += len(t)
    for name in sorted(tot):
        print(f"{name:28s} {tot[name]:5d} tokens  {100 * deep[name] / tot[name]:5.1f} % deep")


if __name__ == "__main__":
    main()
