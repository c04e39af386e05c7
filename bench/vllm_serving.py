"""vLLM serving rows: TaH2 (M = 2, random decider) tokens/s ÷ plain Qwen3 (vLLM's own Qwen3 model), same weights.

Run in the vLLM venv (`make test-vllm` creates it); the models are built, and our HF `generate` is timed, by the
project's own Python:

    HF_LOOPS_REFERENCE_PYTHON=.venv/bin/python VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_serving.py \
        [--batches 1,8,32] [--new 32] [--repeats 2] [--out bench/results]

Workload per batch size B: B requests submitted together, 64-token random prompts, `--new` new tokens each (greedy,
EOS ignored), float32, eager; one warm-up, then best of `--repeats` `generate` calls per model, interleaved. tokens/s
counts the generated tokens over the whole call (prefill included). Per row: the ratio TaH2 ÷ Qwen3 in vLLM, the
realised mean depth (per request, from the depth-statistics connector), the FLOPs bound (Qwen3's decode FLOPs ÷
TaH2's for the realised depths, `hf_loops.core.flops_tah2`: what the ratio would be if time followed FLOPs), vLLM
TaH2 ÷ our HF TaH2 `generate` (same batch, same tokens), and the KV bytes vLLM reserves per token for each model.
Writes `<out>/cpu-vllm.json` and `<out>/cpu-vllm.md` and prints the table.
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
QWEN = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)
PROMPT = 64
STATS = {"kv_connector": "DepthStatsConnector", "kv_role": "kv_both",
         "kv_connector_module_path": "hf_loops.serving.vllm_stats"}


def reference_python():
    return os.environ.get("HF_LOOPS_REFERENCE_PYTHON", os.path.join(REPO, ".venv", "bin", "python"))


def reference_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM")}
    env["PYTHONPATH"] = REPO
    return env


def build(root):
    # decider score weights N(0, 2/√d) as in the HF bench rows: g spreads over (0, 1)
    spec = {"bench": {"seed": 0, "qwen": QWEN, "tah2": {"max_iterations": 2}, "decider_std": 2 / QWEN["hidden_size"] ** 0.5,
                      "save_base": True, "prompts": [], "max_new_tokens": 1}}
    with open(os.path.join(root, "specs.json"), "w") as f:
        json.dump(spec, f)
    subprocess.run([reference_python(), os.path.join(REPO, "tests", "serving", "vllm_reference.py"),
                    os.path.join(root, "specs.json"), root], check=True, env=reference_env())
    return os.path.join(root, "bench", "base"), os.path.join(root, "bench", "model")


def hf_generate_seconds(model_dir, prompts, new, repeats, root):
    """Best-of-`repeats` seconds of our HF `generate` (greedy, batch = all prompts, equal lengths), in .venv."""
    path = os.path.join(root, "hf_prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    out = subprocess.run([reference_python(), os.path.join(REPO, "tests", "serving", "vllm_reference.py"), "--time",
                          model_dir, path, str(new), str(repeats)], check=True, env=reference_env(),
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def kv_bytes_per_token(model) -> int:
    """KV bytes vLLM allocated per token over every attention layer of the model (+ TaH2's depth marker)."""
    from vllm.model_executor.layers.attention import Attention

    total = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.kv_cache.numel():
            cache = module.kv_cache
            total += cache.numel() * cache.element_size() // (cache.shape[0] * cache.shape[2])
    runtime = getattr(model, "runtime", None)
    if runtime is not None and runtime.marker is not None:
        total += runtime.marker.element_size()
    return total


def flops_bound(config, stats: list[dict], new: int) -> float:
    """Qwen3 decode FLOPs ÷ TaH2's for the realised per-request depth counts (depth lists rebuilt from the counts)."""
    from hf_loops.core.flops_tah2 import decode_flops_standard, decode_flops_tah2

    def depths(counts):
        reached = counts + [0]
        return [m + 1 for m in range(len(counts)) for _ in range(reached[m] - reached[m + 1])]

    total_std = total_tah2 = 0.0
    for s in stats:
        out = depths(s["output"]["tokens_per_depth"])
        total_std += decode_flops_standard(config, PROMPT, len(out))
        total_tah2 += decode_flops_tah2(config, out, depths(s["prompt"]["tokens_per_depth"]), config.max_iterations)
    return total_std / total_tah2


def measure(llms, prompts, params, repeats):
    best = {name: float("inf") for name in llms}
    for llm in llms.values():  # warm-up
        llm.generate(prompts, params, use_tqdm=False)
    outs = None
    for _ in range(repeats):
        for name, llm in llms.items():
            t = time.perf_counter()
            result = llm.generate(prompts, params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - t)
            if name == "tah2":
                outs = result
    return best, outs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = p.parse_args(argv)
    import vllm
    from transformers import AutoConfig
    from vllm.inputs import TokensPrompt

    import hf_loops  # noqa: F401  (registers TaH2's config with AutoConfig)

    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    all_prompts = [[rng.randrange(3, 8000) for _ in range(PROMPT)] for _ in range(max(batches))]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    rows, load = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        dirs = dict(zip(("qwen3", "tah2"), build(root), strict=True))
        config = AutoConfig.from_pretrained(dirs["tah2"])
        llms = {name: vllm.LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=256,
                               max_num_seqs=max(batches), enable_prefix_caching=False, seed=0,
                               kv_transfer_config=STATS) for name, d in dirs.items()}
        # (Qwen3 too: vLLM's KV transfer group is per process, so two engines in one process both need the
        # connector; for Qwen3 it returns nothing)
        kv = {name: llm.apply_model(kv_bytes_per_token)[0] for name, llm in llms.items()}
        for B in batches:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in all_prompts[:B]]
            best, outs = measure(llms, prompts, params, args.repeats)
            stats = [o.kv_transfer_params["depth_statistics"] for o in outs]
            counts = [sum(s["output"]["tokens_per_depth"][m] for s in stats) for m in range(2)]
            hf = hf_generate_seconds(dirs["tah2"], all_prompts[:B], args.new, args.repeats, root)
            tps = {name: B * args.new / t for name, t in best.items()}
            rows.append({"row": f"vllm-tah2-b{B}", "batch": B, "tah2_tokens_per_s": tps["tah2"],
                         "qwen3_tokens_per_s": tps["qwen3"], "ratio": tps["tah2"] / tps["qwen3"],
                         "mean_depth": sum(counts) / counts[0], "flops_bound": flops_bound(config, stats, args.new),
                         "hf_generate_tokens_per_s": B * args.new / hf, "vs_hf_generate": tps["tah2"] * hf / (B * args.new),
                         "kv_bytes_per_token": kv})
            print(json.dumps(rows[-1]), flush=True)
    write(rows, args, load, vllm.__version__)


def write(rows, args, load, vllm_version):
    import torch

    settings = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "vllm": vllm_version,
                "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                "load_average_at_start": load, "machine": platform.machine(), "model": {**QWEN, "max_iterations": 2},
                "workload": {"prompt": PROMPT, "new_tokens": args.new, "repeats": args.repeats}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu-vllm.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=1)
    lines = ["| id | TaH2 ÷ Qwen3 tokens/s in vLLM | TaH2 / Qwen3 tokens/s | mean depth | FLOPs bound | "
             "vLLM TaH2 ÷ HF generate | KV bytes/token TaH2 / Qwen3 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['ratio']:.2f}× | {r['tah2_tokens_per_s']:.0f} / {r['qwen3_tokens_per_s']:.0f} | "
                     f"{r['mean_depth']:.2f} | {r['flops_bound']:.2f}× | {r['vs_hf_generate']:.2f}× "
                     f"({r['hf_generate_tokens_per_s']:.0f} tokens/s) | {r['kv_bytes_per_token']['tah2']} / "
                     f"{r['kv_bytes_per_token']['qwen3']} |")
    text = "\n".join(lines) + f"\n\nload average at start {load:.1f} on {os.cpu_count()} cores\n"
    with open(os.path.join(args.out, "cpu-vllm.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
