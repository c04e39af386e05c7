"""Recipe sweep for the arithmetic demo task, on its VALIDATION split (never the held-out one).

    OMP_NUM_THREADS=1 python examples/arithmetic_sweep.py --arch standard tah2 tah2-fixed --steps 150 --seed 0

Post-trains the embedded base once per --arch with the demo's shared settings plus the overrides given, evaluates on
the validation split and prints one JSON line per run (answer NLL, exact match, depths, decode FLOPs, training time,
deep-token shares per token class).
"""

import argparse
import json
import os
import re
import shutil
import tempfile
import time

from hf_loops.data import arithmetic as A
from hf_loops.data import default_base_dir
from hf_loops.demo.runs import float32_base, train_one
from hf_loops.demo.settings import DEMO_TRAINING
from hf_loops.evaluation.cli import set_threads
from hf_loops.evaluation.examples import load_examples
from hf_loops.evaluation.metrics import evaluate


def digit_runs(items, max_new_tokens):
    """Longest run of consecutive digit characters per generation: max, mean, and the share of generations that
    ran to the token limit (did not stop)."""
    runs = [max((len(x) for x in re.findall(r"\d+", e["generated_text"])), default=0) for e in items]
    return {"max_digit_run": max(runs), "mean_longest_digit_run": round(sum(runs) / len(runs), 2),
            "hit_limit": sum(e["generated_tokens"] >= max_new_tokens for e in items) / len(items)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", nargs="+", default=["standard", "tah2", "tah2-fixed"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=40)
    p.add_argument("--split", default="validation", choices=["validation", "heldout"])
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], help="KEY=VALUE training overrides (JSON values)")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--keep", default=None, help="keep the checkpoints in this folder")
    a = p.parse_args()
    set_threads(1)
    spec = A.TaskSpec(digits=a.digits, max_steps=a.max_steps)
    work = tempfile.mkdtemp(prefix="arith_sweep_")
    paths = A.write_splits(os.path.join(work, "data"), n_train=a.n_train, n_validation=a.n_eval, n_heldout=a.n_eval,
                           seed=a.data_seed, spec=spec)
    base32 = float32_base(default_base_dir(), os.path.join(work, "base32"))
    settings = {**DEMO_TRAINING, "max_steps": a.steps, "max_length": 160, "disable_tqdm": True, "logging_steps": 10}
    for kv in a.set:
        k, v = kv.split("=", 1)
        settings[k] = json.loads(v)
    examples = load_examples(paths[a.split])
    for arch in a.arch:
        out = os.path.join(a.keep or work, f"{arch}_s{a.seed}")
        if os.path.isdir(out):
            shutil.rmtree(out)
        summ = train_one(base32, arch, paths["train"], out, settings, a.seed)
        t1 = time.perf_counter()
        r = evaluate(out, examples=examples, batch_size=20, max_new_tokens=a.max_new_tokens, progress=False)
        m = r["metrics"]
        shares = A.class_deep_shares(r["examples"])
        rec = {"arch": arch, "seed": a.seed, "steps": a.steps, "set": a.set, "digits": a.digits,
               "answer_nll": round(m["answer_nll"], 4), "exact_match": m["exact_match"],
               "mean_depth": m.get("mean_depth"), "mean_depth_generated": m.get("mean_depth_generated"),
               "decode_flops_per_token": m["decode_flops_per_token"], "train_s": round(summ["train_runtime"], 1),
               "eval_s": round(time.perf_counter() - t1, 1), "final_ntp": summ["final_ntp_loss"],
               "gen_tokens": m["generated_tokens"], **digit_runs(r["examples"], a.max_new_tokens),
               "deep_share": {c: (None if v["deep_share"] is None else round(v["deep_share"], 3))
                              for c, v in shares.items()},
               "sample": r["examples"][0]["generated_text"][:160]}
        print(json.dumps(rec), flush=True)
    if not a.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
