"""vLLM serving rows: TaH2 (M = 2, random decider) tokens/s ÷ plain Qwen3 (vLLM's own Qwen3 model), same weights.

Run in the vLLM venv (`make test-vllm` creates it); the models are built, and our HF `generate` is timed, in a
subprocess of the same Python (`HF_LOOPS_REFERENCE_PYTHON` names another one):

    .venv-vllm/bin/python bench/vllm_serving.py \
        [--workload serving|closed] [--sizes small,100m] [--batches 1,8,32] [--new 16] [--rounds 5] [--threads 1] \
        [--out bench/results]

`--workload serving` (the default; `cpu-vllm-serving.{json,md}`): per batch size B, 4 × B requests queued at once
with max_num_seqs = B (freed slots refill), 65-token prompts whose first two 32-token blocks come from the prefix
cache (warmed first), so every step runs one token per request; tokens/s over all steps of a round, `--rounds`
rounds alternating the two engines, each listed; d̄ = mean executed depth of TaH2's generated tokens; depth-bound
efficiency = TaH2 ÷ Qwen3 tokens/s × d̄, which is exactly fill × step cost ratio: fill = Qwen3's engine steps × d̄ ÷
TaH2's (how full of depths TaH2's steps are, against Qwen3's steps full of tokens: below 1 once the queue is empty and
the last requests drain, each at its own depths) and step cost ratio = Qwen3's ms per step ÷ TaH2's (what one TaH2
step costs beyond a Qwen3 step: decider, updater, deeper attention). With `HF_LOOPS_VLLM_DEPTH_SCHEDULING=0` in the
environment, TaH2 runs
every depth within its step (the setting is recorded in the results). `--workload closed`, described below
(`cpu-vllm.{json,md}`), is the closed-batch workload.

Sizes (vocabulary 8,192: the embedded base's tokenizer): `small` = hidden 256 × 4 layers (per-op overhead dominates
a decode step), `100m` = hidden 1024 × 8 layers, FFN 3072 (the HF bench's 100m backbone: matmuls dominate).

Workload per batch size B: B requests added together, 64-token random prompts, `--new` new tokens each (greedy, EOS
ignored), float32, eager, one engine in this process per model. The first engine step prefills every prompt and
samples the first tokens (the token budget holds all prompts); the remaining `--new` − 1 steps are the decode.
Timing: wall clock of each engine step, `--rounds` rounds that alternate the two models (and our HF `generate`
between batch sizes), best round per model; `--threads` CPU threads for both engines and for HF (default 1: on a
shared machine vLLM's multi-threaded CPU kernels wait for a busy core at every call, which swamps the comparison).

Per row: decode tokens/s of TaH2 ÷ Qwen3 against two bounds: the FLOPs bound (Qwen3's decode FLOPs ÷ TaH2's for the
realised per-token depths, `hf_loops.core.flops_tah2`: what the ratio would be if time followed FLOPs) and the pass
bound (decode steps ÷ backbone passes TaH2 ran in them: what it would be if every pass cost a full read of the
weights, however few tokens it carries, as for decode batches on a CPU); the same ratio over the
whole call (prefill included: TaH2 also runs the decider, hence the LM head, on every prompt token, and its prompt
tokens iterate too; no bound given), the realised mean depth of the generated tokens (depth-statistics connector), vLLM
TaH2 ÷ our HF TaH2 `generate` (decode, and whole call: same batch, same tokens, same threads), and the KV bytes vLLM
reserves per token for each model. Writes `<out>/cpu-vllm.json` and `<out>/cpu-vllm.md` and prints the table.
"""

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SIZES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "100m": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64),
}
PROMPT = 64
SERVE_BLOCK = 32  # KV block size of the serving workload (its prompts: 2 full blocks + 1 token; CPU: a multiple of 32)
STATS = {"kv_connector": "DepthStatsConnector", "kv_role": "kv_both",
         "kv_connector_module_path": "hf_loops.serving.vllm_stats"}


def reference_python():
    return os.environ.get("HF_LOOPS_REFERENCE_PYTHON", sys.executable)


def reference_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM")}
    env["PYTHONPATH"] = REPO
    return env


def build(root, qwen):
    # decider score weights N(0, 2/√d) as in the HF bench rows: g spreads over (0, 1)
    spec = {"bench": {"seed": 0, "qwen": qwen, "tah2": {"max_iterations": 2}, "decider_std": 2 / qwen["hidden_size"] ** 0.5,
                      "save_base": True, "prompts": [], "max_new_tokens": 1}}
    with open(os.path.join(root, "specs.json"), "w") as f:
        json.dump(spec, f)
    subprocess.run([reference_python(), os.path.join(REPO, "tests", "serving", "vllm_reference.py"),
                    os.path.join(root, "specs.json"), root], check=True, env=reference_env())
    return os.path.join(root, "bench", "base"), os.path.join(root, "bench", "model")


def hf_generate_seconds(model_dir, prompts, new, rounds, root) -> tuple[float, float]:
    """Best seconds of our HF `generate` (greedy, batch = all prompts, equal lengths) for `new` tokens and for one
    token (the prefill), in the project's Python."""
    path = os.path.join(root, "hf_prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    out = subprocess.run([reference_python(), os.path.join(REPO, "tests", "serving", "vllm_reference.py"), "--time",
                          model_dir, path, str(new), str(rounds)], check=True, env=reference_env(),
                         capture_output=True, text=True)
    total, first = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return total, first


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


def depth_list(counts):
    """Per-token depths rebuilt from tokens-per-depth counts (tokens that reached depth m+1)."""
    reached = counts + [0]
    return [m + 1 for m in range(len(counts)) for _ in range(reached[m] - reached[m + 1])]


def flops_bound(config, stats: list[dict]) -> float:
    """Qwen3 decode FLOPs ÷ TaH2's for the realised per-request depth counts of the generated tokens fed back."""
    from hf_loops.core.flops_tah2 import decode_flops_standard, decode_flops_tah2

    total_std = total_tah2 = 0.0
    for s in stats:
        out = depth_list(s["output"]["tokens_per_depth"])
        total_std += decode_flops_standard(config, PROMPT, len(out))
        total_tah2 += decode_flops_tah2(config, out, depth_list(s["prompt"]["tokens_per_depth"]), config.max_iterations)
    return total_std / total_tah2


def queue(llm, prompts, params):
    """Add every prompt to the engine (ids unique to this call, numbered in order); returns the engine."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    tag = f"{time.monotonic_ns()}"
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=ids), params)
    return engine


def engine_round(llm, prompts, params, looped: bool) -> tuple[float, float, list, dict | None]:
    """One batch through the engine: seconds of the first step (prefill + first tokens), seconds of the decode steps,
    the finished outputs, and (TaH2) the model's engine-wide depth statistics of the decode steps."""
    engine = queue(llm, prompts, params)
    done = []
    t = time.perf_counter()
    done += [o for o in engine.step() if o.finished]
    first = time.perf_counter() - t
    if looped:
        llm.apply_model(lambda model: model.depth_statistics(reset=True))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    decode = time.perf_counter() - t
    steps = llm.apply_model(lambda model: model.depth_statistics())[0] if looped else None
    return first, decode, sorted(done, key=lambda o: int(o.request_id.rsplit("-", 1)[1])), steps


def measure(llms, dirs, config, prompts, params, args, root, kv) -> dict:
    B, new = len(prompts), params.max_tokens
    for name, llm in llms.items():  # warm-up
        engine_round(llm, prompts, params, name == "tah2")
    first = {name: float("inf") for name in llms}
    decode = dict(first)
    for _ in range(args.rounds):
        for name, llm in llms.items():
            f, d, outs, engine_stats = engine_round(llm, prompts, params, name == "tah2")
            first[name], decode[name] = min(first[name], f), min(decode[name], d)
            if name == "tah2":
                stats = [o.kv_transfer_params["depth_statistics"] for o in outs]
                steps = engine_stats["steps_per_pass"]
    hf_total, hf_first = hf_generate_seconds(dirs["tah2"], prompts, new, args.rounds, root)
    decode_tokens, total_tokens = B * (new - 1), B * new
    tps = {name: decode_tokens / decode[name] for name in llms}
    total_tps = {name: total_tokens / (first[name] + decode[name]) for name in llms}
    counts = [sum(s["output"]["tokens_per_depth"][m] for s in stats) for m in range(2)]
    return {
        "batch": B, "decode_tokens_per_s": tps, "ratio": tps["tah2"] / tps["qwen3"],
        "flops_bound": flops_bound(config, stats),
        # Qwen3 reads all weights once per decode step, TaH2 once per depth it runs in the step
        "pass_bound": steps[0] / sum(steps), "decode_steps_per_pass": steps,
        "whole_call_tokens_per_s": total_tps, "whole_call_ratio": total_tps["tah2"] / total_tps["qwen3"],
        "mean_depth": sum(counts) / counts[0],
        "prompt_mean_depth": sum(s["prompt"]["mean_depth"] for s in stats) / len(stats),
        "hf_generate": {"decode_tokens_per_s": decode_tokens / (hf_total - hf_first),
                        "whole_call_tokens_per_s": total_tokens / hf_total},
        "vs_hf_generate": tps["tah2"] * (hf_total - hf_first) / decode_tokens,
        "whole_call_vs_hf_generate": total_tps["tah2"] * hf_total / total_tokens,
        "seconds": {"first_step": first, "decode": decode, "hf_total": hf_total, "hf_first": hf_first},
        "kv_bytes_per_token": kv, "load_average": os.getloadavg()}



# ----------------------------------------------------------------------------------------------------------------------
# The serving workload: 4 × B requests queued, max_num_seqs = B (freed slots refill)
# ----------------------------------------------------------------------------------------------------------------------


def serving_round(llm, prompts, params) -> tuple[int, float, list, int]:
    """All `prompts` queued at once; returns the tokens generated, the seconds of all engine steps, the finished
    outputs and the number of engine steps."""
    engine = queue(llm, prompts, params)
    done, steps = [], 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        steps += 1
    seconds = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in done), seconds, done, steps


def measure_serving(dirs, B: int, prompts, params, rounds: int) -> dict:
    """TaH2 ÷ Qwen3 decode tokens/s on the serving workload, per round (rounds alternate the two engines), the mean
    executed depth d̄ of TaH2's generated tokens and the depth-bound efficiency ratio × d̄. The prompts' KV comes
    from the prefix cache (warmed before the rounds; 32-token blocks, prompts of 2 blocks + 1 token), so every
    engine step, also one that admits a request, runs one token per request: decode only, with refills."""
    import torch
    import vllm

    # on a GPU the two engines share the device's memory
    memory = {"gpu_memory_utilization": 0.4} if torch.cuda.is_available() else {}
    llms = {name: vllm.LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=B,
                           max_num_batched_tokens=max(2048, B * len(prompts[0])), block_size=SERVE_BLOCK,
                           enable_prefix_caching=True, seed=0, kv_transfer_config=STATS, **memory)
            for name, d in dirs.items()}
    warm = vllm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for llm in llms.values():  # the prefix cache, and one round to warm up
        serving_round(llm, prompts, warm)
        serving_round(llm, prompts[:B], params)
    llms["tah2"].apply_model(lambda model: model.depth_statistics(reset=True))
    tps = {name: [] for name in llms}
    steps, step_ms = {name: [] for name in llms}, {name: [] for name in llms}
    counts, cached, prompt_tokens = [0, 0], 0, 0
    for _ in range(rounds):
        for name, llm in llms.items():
            tokens, seconds, outs, n = serving_round(llm, prompts, params)
            tps[name].append(tokens / seconds)
            steps[name].append(n)
            step_ms[name].append(1e3 * seconds / n)
            cached += sum(o.num_cached_tokens or 0 for o in outs)
            prompt_tokens += sum(len(o.prompt_token_ids) for o in outs)
            if name == "tah2":
                stats = [o.kv_transfer_params["depth_statistics"]["output"]["tokens_per_depth"] for o in outs]
                counts = [counts[m] + sum(s[m] for s in stats) for m in range(2)]
    (engine_stats,) = llms["tah2"].apply_model(lambda model: model.depth_statistics())
    del llms
    gc.collect()
    ratios = [a / b for a, b in zip(tps["tah2"], tps["qwen3"], strict=True)]
    mean_depth = sum(counts) / counts[0]
    effs = [r * mean_depth for r in ratios]
    # efficiency = fill × step cost ratio: fill = Qwen3's steps × d̄ ÷ TaH2's steps (1.0: TaH2's steps as full of
    # depths as Qwen3's of tokens; below 1 while the last requests drain with uneven depths), step cost ratio = Qwen3's
    # ms per step ÷ TaH2's
    fills = [q * mean_depth / t for q, t in zip(steps["qwen3"], steps["tah2"], strict=True)]
    step_ratios = [q / t for q, t in zip(step_ms["qwen3"], step_ms["tah2"], strict=True)]
    passes = engine_stats["steps_per_pass"]
    return {"batch": B, "requests": len(prompts), "max_num_seqs": B, "decode_tokens_per_s": tps, "ratios": ratios,
            "ratio": statistics.median(ratios), "mean_depth": mean_depth, "efficiencies": effs,
            "efficiency": statistics.median(effs), "engine_steps": steps, "ms_per_step": step_ms,
            "fills": fills, "fill": statistics.median(fills), "step_cost_ratios": step_ratios,
            "step_cost_ratio": statistics.median(step_ratios), "passes_per_step": sum(passes) / passes[0],
            "deferred": engine_stats["deferred"], "prompt_cache_hit": cached / prompt_tokens,
            "load_average": os.getloadavg()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small", help="comma-separated: small, 100m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--workload", default="serving", choices=["serving", "closed"],
                   help="serving: 4 × B requests queued with max_num_seqs = B (cpu-vllm-serving.*); closed: B "
                        "requests together (cpu-vllm.*)")
    args = p.parse_args(argv)
    # before torch and vLLM start: one engine per model in this process, and the thread count for both and for HF
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    import vllm
    from transformers import AutoConfig

    import hf_loops  # noqa: F401  (registers TaH2's config with AutoConfig)

    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    all_prompts = [[rng.randrange(3, 8000) for _ in range(PROMPT)] for _ in range(max(batches))]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    rows, loads = [], {"start": os.getloadavg()}
    if args.workload == "serving":
        queued = [[rng.randrange(3, 8000) for _ in range(2 * SERVE_BLOCK + 1)] for _ in range(4 * max(batches))]
        for size in args.sizes.split(","):
            with tempfile.TemporaryDirectory() as root:
                dirs = dict(zip(("qwen3", "tah2"), build(root, SIZES[size]), strict=True))
                for B in batches:
                    rows.append(measure_serving(dirs, B, queued[:4 * B], params, args.rounds))
                    rows[-1]["row"] = f"vllm-tah2{'' if size == 'small' else '-' + size}-serve-b{B}"
                    rows[-1]["size"] = size
                    print(json.dumps(rows[-1]), flush=True)
        loads["end"] = os.getloadavg()
        return write_serving(rows, args, loads, vllm.__version__)
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as root:
            dirs = dict(zip(("qwen3", "tah2"), build(root, SIZES[size]), strict=True))
            config = AutoConfig.from_pretrained(dirs["tah2"])
            # (Qwen3 gets the connector too: vLLM's KV transfer group is per process; for Qwen3 it returns nothing)
            llms = {name: vllm.LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=256,
                                   max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * PROMPT),
                                   enable_prefix_caching=False, seed=0, kv_transfer_config=STATS)
                    for name, d in dirs.items()}
            kv = {name: llm.apply_model(kv_bytes_per_token)[0] for name, llm in llms.items()}
            for B in batches:
                rows.append(measure(llms, dirs, config, all_prompts[:B], params, args, root, kv))
                rows[-1]["row"] = f"vllm-tah2-b{B}" if size == "small" else f"vllm-tah2-{size}-b{B}"
                rows[-1]["size"] = size
                print(json.dumps(rows[-1]), flush=True)
            del llms
            gc.collect()
    loads["end"] = os.getloadavg()
    write(rows, args, loads, vllm.__version__)


def write(rows, args, loads, vllm_version):
    import torch

    settings = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "vllm": vllm_version,
                "torch": torch.__version__, "threads": args.threads, "cpu_count": os.cpu_count(),
                "load_average": loads, "machine": platform.machine(),
                "models": {size: {**SIZES[size], "vocab_size": 8192, "max_iterations": 2} for size in args.sizes.split(",")},
                "workload": {"prompt": PROMPT, "new_tokens": args.new, "rounds": args.rounds}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu-vllm.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=1)
    lines = ["| id | decode TaH2 ÷ Qwen3 in vLLM | TaH2 / Qwen3 decode tokens/s | mean depth | FLOPs bound | "
             "pass bound | whole call TaH2 ÷ Qwen3 | vLLM TaH2 ÷ HF generate, decode / whole call | "
             "KV bytes/token TaH2 / Qwen3 | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, hf = r["decode_tokens_per_s"], r["hf_generate"]
        lines.append(f"| {r['row']} | {r['ratio']:.2f}× | {t['tah2']:.0f} / {t['qwen3']:.0f} | {r['mean_depth']:.2f} | "
                     f"{r['flops_bound']:.2f}× | {r['pass_bound']:.2f}× | {r['whole_call_ratio']:.2f}× | "
                     f"{r['vs_hf_generate']:.2f}× / "
                     f"{r['whole_call_vs_hf_generate']:.2f}× (HF {hf['decode_tokens_per_s']:.0f} / "
                     f"{hf['whole_call_tokens_per_s']:.0f} tokens/s) | {r['kv_bytes_per_token']['tah2']} / "
                     f"{r['kv_bytes_per_token']['qwen3']} | {r['load_average'][0]:.1f} |")
    start, end = loads["start"], loads["end"]
    text = "\n".join(lines) + (f"\n\n{args.threads} thread(s); load average {start[0]:.1f} / {start[1]:.1f} / "
                               f"{start[2]:.1f} at start, {end[0]:.1f} / {end[1]:.1f} / {end[2]:.1f} at the end, "
                               f"on {os.cpu_count()} cores; best of {args.rounds} interleaved rounds\n")
    with open(os.path.join(args.out, "cpu-vllm.md"), "w") as f:
        f.write(text)
    print(text)


def write_serving(rows, args, loads, vllm_version):
    import torch

    settings = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "vllm": vllm_version,
                "torch": torch.__version__, "threads": args.threads, "cpu_count": os.cpu_count(),
                "load_average": loads, "models": {size: SIZES[size] for size in args.sizes.split(",")},
                "HF_LOOPS_VLLM_DEPTH_SCHEDULING": os.environ.get("HF_LOOPS_VLLM_DEPTH_SCHEDULING", "1"),
                "workload": {"prompt": 2 * SERVE_BLOCK + 1, "block_size": SERVE_BLOCK, "new_tokens": args.new,
                             "rounds": args.rounds, "requests": "4 × B, max_num_seqs = B",
                             "timed": "every engine step; prompts from the prefix cache but their last token"}}
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with open(os.path.join(args.out, f"{device}-vllm-serving.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=1)
    lines = ["| id | TaH2 ÷ Qwen3 decode tokens/s, median (rounds) | d̄ | depth-bound efficiency, median (rounds) | "
             "= fill × step cost ratio, medians | engine steps Qwen3 / TaH2 | ms per step Qwen3 / TaH2 | "
             "passes per TaH2 step | prompt tokens from the prefix cache | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps, ms = r["engine_steps"], r["ms_per_step"]
        lines.append(f"| {r['row']} | {r['ratio']:.3f} ({', '.join(f'{x:.3f}' for x in r['ratios'])}) | "
                     f"{r['mean_depth']:.3f} | {r['efficiency']:.3f} ({', '.join(f'{x:.3f}' for x in r['efficiencies'])})"
                     f" | {r['fill']:.3f} × {r['step_cost_ratio']:.3f} | {steps['qwen3'][0]} / {steps['tah2'][0]} | "
                     f"{statistics.median(ms['qwen3']):.1f} / {statistics.median(ms['tah2']):.1f} | "
                     f"{r['passes_per_step']:.2f} | {100 * r['prompt_cache_hit']:.1f} % | {r['load_average'][0]:.1f} |")
    start, end = loads["start"], loads["end"]
    text = "\n".join(lines) + (f"\n\n{args.threads} thread(s); load average {start[0]:.1f} at start, {end[0]:.1f} "
                               f"at the end, on {os.cpu_count()} cores; {args.rounds} interleaved rounds. fill = "
                               "Qwen3's engine steps × d̄ ÷ TaH2's (below 1 while the last requests drain with uneven "
                               "depths); step cost ratio = Qwen3's ms per step ÷ TaH2's\n")
    with open(os.path.join(args.out, f"{device}-vllm-serving.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
