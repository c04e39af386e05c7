"""Experimental (issue 31): with NO training, what does pass 2 of the 2-layer hop base compute, per updater and
iteration attention? Teacher-forced per-level argmax accuracy of the depth-2 logits (mixture "final", every token
deep) on 1000 validation problems, against the base's own (depth-1) accuracy.

    PYTHONPATH=. python experiments/depth_bound/probe_pass2.py --base out/hop2/base_L2
"""

import argparse
import json

import common as C
import hop2_task as H2
import torch

from hf_loops.conversion import convert_qwen3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="out/hop2/base_L2")
    p.add_argument("--n", type=int, default=1000)
    a = p.parse_args()
    torch.set_num_threads(1)
    enc = C.CharEncoder(C.tokenizer())
    va = C.tensors_levels(enc, H2.make_split("validation", a.n, 0), H2.levels(2))
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(a.base).float()
    print("base", json.dumps(C.score(base, va)["level_accuracy"]))
    for updater in ("topk_embedding", "hidden", "learned", "identity"):
        for attn in ("duo", "causal", "same_iter"):
            m = convert_qwen3(base, "tah2", seed=0, updater=updater, iteration_attention=attn, decider="always",
                              mixture="final").float()
            s = C.score(m, va)
            print(f"pass 2 | updater {updater:14s} attention {attn:9s}",
                  json.dumps({k: round(v, 3) for k, v in s["level_accuracy"].items()}), flush=True)


if __name__ == "__main__":
    main()
