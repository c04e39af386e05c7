"""vLLM serving row: TaH2 (M = 2, random decider) tokens/s ÷ plain Qwen3 (vLLM's own Qwen3 model), same weights.

Run in the vLLM venv (`make test-vllm` creates it); the models are built by the project's own Python:

    HF_LOOPS_REFERENCE_PYTHON=.venv/bin/python VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_serving.py

Workload: batch 8 (8 requests submitted together), 64-token random prompts, 32 new tokens each (greedy, EOS
ignored), float32, eager; one warm-up, then best of 2 `generate` calls per model, interleaved. tokens/s counts the
generated tokens over the whole call (prefill included). Prints one markdown row with the realised mean depth.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)
BATCH, PROMPT, NEW, REPEATS = 8, 64, 32, 2


def build(root):
    python = os.environ.get("HF_LOOPS_REFERENCE_PYTHON", os.path.join(REPO, ".venv", "bin", "python"))
    # decider score weights N(0, 2/√d) as in the HF bench rows: g spreads over (0, 1)
    spec = {"bench": {"seed": 0, "qwen": QWEN, "tah2": {"max_iterations": 2}, "decider_std": 2 / QWEN["hidden_size"] ** 0.5,
                      "save_base": True, "prompts": [], "max_new_tokens": 1}}
    with open(os.path.join(root, "specs.json"), "w") as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM")}
    env["PYTHONPATH"] = REPO
    subprocess.run([python, os.path.join(REPO, "tests", "serving", "vllm_reference.py"),
                    os.path.join(root, "specs.json"), root], check=True, env=env)
    return os.path.join(root, "bench", "base"), os.path.join(root, "bench", "model")


def main():
    import vllm
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 8000) for _ in range(PROMPT)]) for _ in range(BATCH)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    with tempfile.TemporaryDirectory() as root:
        dirs = dict(zip(("qwen3", "tah2"), build(root), strict=False))
        llms = {name: vllm.LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=BATCH,
                               enable_prefix_caching=False, seed=0) for name, d in dirs.items()}
        best = {name: float("inf") for name in llms}
        for name, llm in llms.items():  # warm-up
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
        llms["tah2"].apply_model(lambda m: m.depth_statistics(reset=True))
        for _ in range(REPEATS):
            for name, llm in llms.items():
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best[name] = min(best[name], time.perf_counter() - t)
                print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
        (stats,) = llms["tah2"].apply_model(lambda m: m.depth_statistics())
    tps = {name: BATCH * NEW / t for name, t in best.items()}
    row = {"row": "vllm-tah2-b8", "tah2_tokens_per_s": tps["tah2"], "qwen3_tokens_per_s": tps["qwen3"],
           "ratio": tps["tah2"] / tps["qwen3"], "mean_depth": stats["mean_depth"],
           "continue_rate": stats["continue_rate"], "vllm": vllm.__version__, "torch_threads": None}
    import torch

    row["torch_threads"] = torch.get_num_threads()
    print(json.dumps(row))
    print(f"| vllm-tah2-b8 | TaH2 (M = 2) ÷ Qwen3 tokens/s in vLLM, batch 8 | {row['ratio']:.2f}× | "
          f"{tps['tah2']:.0f} vs {tps['qwen3']:.0f} tokens/s, realised mean depth {row['mean_depth']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
