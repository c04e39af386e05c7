"""Post-train Standard / TaH2 / TaH2-fixed from the depth-bound base through the package's own training API and score
them on the VALIDATION split.

    PYTHONPATH=. python experiments/depth_bound/retrofit.py --tag NAME --archs standard,tah2,tah2-fixed --seeds 0 \
        [--steps 200] [--lr 1e-3] [--alpha-d 1.0] [--warmup-frac 0.33] [--set trainer_field=value ...] \
        [--model model_field=value ...]

Each run is `hf_loops.training.train_tah2.train` (what `hf-loops train --base DIR --arch ARCH` runs) on the train
split, then `hf_loops.evaluation.evaluate` (greedy generation + teacher-forced depths) on the validation split. Per
difficulty level (`hf_loops.data.depth_task`): greedy character accuracy, teacher-forced answer NLL, share of tokens
the decider sends to iteration 2. Results are appended to out/retrofit/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import common as C
import torch

from hf_loops.data import depth_task as D

BASE_TRAINING = {  # TaH2SFTConfig fields shared by every run (the demo's and the tiny-cpu recipe's choices)
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "per_device_train_batch_size": 64,
    "max_length": 96,
    "weight_decay": 0.01,
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 10,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    "disable_tqdm": True,
}


def parse_kv(items):
    out = {}
    for it in items or []:
        k, _, v = it.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def data_files(root: str, n_train: int, n_val: int, spec) -> dict:
    """`spec`: a `DepthTaskSpec` (addition) or a dict of `hop_task.make_problem` arguments (k-hop lookup)."""
    os.makedirs(root, exist_ok=True)
    if isinstance(spec, dict):
        spec = dict(spec)
        import hop2_task as H2
        import hop_task as H1

        fmt = spec.pop("format", "eq")
        if fmt == "pkg":  # the package's generator; post-training data drawn with seed 1 (the base saw seed 0's)
            from hf_loops.data import hop_task as HP

            hp = HP.HopTaskSpec(**spec)
            tag = "hoppkg_" + "_".join(f"{k}{v}" for k, v in sorted(spec.items()))
            make = lambda split, n: HP.make_split(split, n, 1 if split == "train" else 0, hp)  # noqa: E731
        else:
            H = H2 if fmt == "at_x" else H1
            tag = ("hop2_" if H is H2 else "hop_") + "_".join(f"{k}{v}" for k, v in sorted(spec.items()))
            make = lambda split, n: H.make_split(split, n, 0, **spec)  # noqa: E731
    else:
        tag = f"d{spec.digits}_p{spec.nine_prob}"
        make = lambda split, n: D.make_split(split, n, 0, spec)  # noqa: E731
    paths = {}
    for split, n in (("train", n_train), ("validation", n_val)):
        path = os.path.join(root, f"{split}_{tag}_{n}.jsonl")
        rows = make(split, n)
        if not os.path.isfile(path):
            D.write_sft(path, rows)
        paths[split] = (path, rows)
    return paths


def level_report(result: dict, rows: list[dict]) -> dict:
    """Per level: greedy character accuracy (the generated answer against the reference, position by position), the
    teacher-forced NLL and deep share (answer_depths) of the answer tokens."""
    stats = {}
    for e, r in zip(result["examples"], rows, strict=True):
        gen, ref, labs = e["generated_text"], r["answer"], r["labels"]
        tl = D.token_labels(e["answer_tokens"], ref, labs)
        tl = ["end" if s else x for x, s in zip(tl, e["answer_special"], strict=True)]
        # tokens past the answer text (the newline after <|im_end|>) are "end" too
        pos = 0
        for k, t in enumerate(e["answer_tokens"]):
            if pos >= len(ref):
                tl[k] = "end"
            pos += len(t)
        for k, lab in enumerate(tl):
            s = stats.setdefault(lab, {"tokens": 0, "nll": 0.0, "deep": 0, "depth_tokens": 0, "chars": 0, "right": 0})
            s["tokens"] += 1
            s["nll"] += e["answer_nll"][k]
            if "answer_depths" in e:
                s["deep"] += e["answer_depths"][k] >= 2
                s["depth_tokens"] += 1
        for i, lab in enumerate(labs):
            s = stats[lab]
            s["chars"] += 1
            s["right"] += i < len(gen) and gen[i] == ref[i]
    out = {}
    for lab in sorted(stats, key=lambda x: (x in ("copy", "end"), x)):
        s = stats[lab]
        out[lab] = {"tokens": s["tokens"], "nll": s["nll"] / s["tokens"],
                    "greedy_char_acc": s["right"] / s["chars"] if s["chars"] else None,
                    "deep_share": s["deep"] / s["depth_tokens"] if s["depth_tokens"] else None}
    return out


def run_one(base, arch, seed, train_file, val_examples, val_rows, settings, model_fields, keep, workdir,
            max_new_tokens=48, answer_pattern=r"####\s*(\w+)"):
    from hf_loops.evaluation.metrics import evaluate
    from hf_loops.training.train_tah2 import train

    out = os.path.join(workdir, f"{arch}_s{seed}_{os.getpid()}")
    if os.path.isdir(out):
        shutil.rmtree(out)
    t0 = time.perf_counter()
    model = model_fields if arch != "standard" else None
    trainer = train(base, train_file, out, arch, model=model, trainer={**settings, "seed": seed})
    wall = time.perf_counter() - t0
    hist = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    t1 = time.perf_counter()
    # addition restates the operands, then digits + 1 result digits and the answer line: 3·digits + ~12 tokens
    res = evaluate(out, examples=val_examples, batch_size=250, max_new_tokens=max_new_tokens, progress=False,
                   decider_accuracy=False, answer_pattern=answer_pattern)
    ev = time.perf_counter() - t1
    m = res["metrics"]
    # Eq. 18 for TaH2-fixed, recomputed here as a check: `evaluate` now prices TaH2-fixed by Eq. 18 too
    # (`core.flops_tah2.decode_flops` dispatches on the configuration; before, it charged Eqs. 14-16).
    from transformers import AutoConfig, AutoTokenizer

    from hf_loops.core.flops_tah2 import decode_flops_fixed

    cfg, tok = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    P = len(tok.apply_chat_template(val_examples[0].prompt, add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"])
    n_pos = sum(e["generated_tokens"] for e in res["examples"])
    eq18 = sum(decode_flops_fixed(cfg, P, e["generated_tokens"], 2) for e in res["examples"]) / n_pos
    rec = {"arch": arch, "seed": seed, "train_wall_s": round(wall, 1), "eval_wall_s": round(ev, 1),
           "train_runtime": next((h["train_runtime"] for h in hist if "train_runtime" in h), None),
           "exact_match": m["exact_match"], "answer_nll": m["answer_nll"],
           "mean_depth": m.get("mean_depth") or 1.0, "decode_flops_per_token": m["decode_flops_per_token"],
           "decode_flops_fixed_eq18_per_token": eq18 if arch == "tah2-fixed" else None,
           "continue_rate": m.get("continue_rate"), "levels": level_report(res, val_rows),
           "log": [h for h in hist if "loss" in h]}
    if not keep:
        shutil.rmtree(out)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", required=True)
    p.add_argument("--base", default=os.path.join(C.OUT, "base"))
    p.add_argument("--archs", default="standard,tah2,tah2-fixed")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--alpha-d", type=float, default=1.0)
    p.add_argument("--warmup-frac", type=float, default=0.33, help="threshold warm-up, a fraction of the steps")
    p.add_argument("--digits", type=int, default=4)
    p.add_argument("--nine-prob", type=float, default=0.3)
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--task", default="addition", choices=["addition", "hop", "hop2", "hoppkg"])
    p.add_argument("--n-sym", type=int, default=8)
    p.add_argument("--n-queries", type=int, default=4)
    p.add_argument("--max-hops", type=int, default=2)
    p.add_argument("--set", nargs="*", help="more trainer fields, field=json")
    p.add_argument("--model", nargs="*", help="TaH2Config fields for the looped runs, field=json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from hf_loops.evaluation.examples import load_examples

    if a.task in ("hop", "hop2", "hoppkg"):
        spec = {"n_sym": a.n_sym, "n_queries": a.n_queries, "max_hops": a.max_hops,
                "format": {"hop2": "at_x", "hoppkg": "pkg"}.get(a.task, "eq")}
    else:
        spec = D.DepthTaskSpec(digits=a.digits, nine_prob=a.nine_prob)
    root = os.path.join(C.OUT, "retrofit")
    files = data_files(os.path.join(root, "data"), a.steps * a.batch, a.n_val, spec)
    val_examples = load_examples(files["validation"][0])
    settings = {**BASE_TRAINING, "max_steps": a.steps, "learning_rate": a.lr, "per_device_train_batch_size": a.batch,
                "decider_loss_weight": a.alpha_d, "base_warmup_steps": int(round(a.warmup_frac * a.steps)),
                **parse_kv(a.set)}
    model_fields = {"max_iterations": 2, **parse_kv(a.model)}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for arch in a.archs.split(","):
            rec = run_one(a.base, arch, seed, files["train"][0], val_examples, files["validation"][1], settings,
                          model_fields, a.keep, os.path.join(root, "runs"), max_new_tokens=(6 * a.n_queries + 8 if a.task.startswith("hop") else 3 * a.digits + 16),
                          answer_pattern=r"####\s*([0-9a-z ]+)" if a.task in ("hop2", "hoppkg") else r"####\s*(\w+)")
            rec.update(tag=a.tag, settings=settings, model_fields=model_fields if arch != "standard" else {},
                       base=a.base, command="python experiments/depth_bound/retrofit.py " + " ".join(argv or []))
            with open(os.path.join(root, "results.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            lv = rec["levels"]
            print(f"[{a.tag}] {arch:10s} seed {seed}: exact {100 * rec['exact_match']:5.1f}%  depth "
                  f"{rec['mean_depth']:.3f}  flops/tok {rec['decode_flops_per_token']:.4g}  train {rec['train_wall_s']}s"
                  f"  eval {rec['eval_wall_s']}s\n   acc " + " ".join(
                      f"{k}:{100 * v['greedy_char_acc']:.1f}" for k, v in lv.items() if v["greedy_char_acc"] is not None)
                  + "\n   deep " + " ".join(f"{k}:{100 * (v['deep_share'] or 0):.0f}" for k, v in lv.items()),
                  flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
