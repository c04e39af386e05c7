"""Where a TaH2 step goes in vLLM on the serving workload of `bench/vllm_serving.py` (4 × B requests, max_num_seqs
B, prompts from the prefix cache): wall ms per engine step of Qwen3 and TaH2, and for TaH2 the ms per step inside
each part of the model (timers around them; nested parts are also counted in their parent: `deep_attention` and
`deep_plan` lie inside `backbone` and `pass_plan`). Run in the vLLM venv:

    .venv-vllm/bin/python bench/profile_vllm_serving.py [size: small|100m] [batch]

Not a bench row: a diagnostic, one round, one thread.
"""

import collections
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import vllm_serving as serving  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def instrument() -> None:
    from hf_loops.modeling import modeling_tah2
    from hf_loops.serving import vllm_tah2

    model = vllm_tah2.TaH2ForCausalLMvLLM
    for owner, name, key in [(model, "forward", "forward"), (vllm_tah2._Backbone, "run", "backbone"),
                             (vllm_tah2._SelfAttention, "_deep_attention", "deep_attention"),
                             (model, "_pass_plan", "pass_plan"), (vllm_tah2, "DeepPlan", "deep_plan"),
                             (vllm_tah2._Step, "plan", "step_plan"), (vllm_tah2._Step, "defer", "defer"),
                             (vllm_tah2, "continue_logit", "decider"), (vllm_tah2, "next_input", "updater"),
                             (model, "_logits", "lm_head"), (model, "compute_logits", "compute_logits"),
                             (modeling_tah2.StoppingWeightedMixture, "add_distribution", "mixture"),
                             (vllm_tah2.vllm_stats, "record", "statistics")]:
        timed(owner, name, key)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    size, B = (argv[0] if argv else "100m"), int(argv[1]) if len(argv) > 1 else 8
    import vllm

    instrument()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(2 * serving.SERVE_BLOCK + 1)] for _ in range(4 * B)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    warm = vllm.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as root:
        for name, path in zip(("qwen3", "tah2"), serving.build(root, serving.SIZES[size]), strict=True):
            llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=B,
                           max_num_batched_tokens=2048, block_size=serving.SERVE_BLOCK, enable_prefix_caching=True,
                           seed=0, kv_transfer_config=serving.STATS)
            serving.serving_round(llm, prompts, warm)
            serving.serving_round(llm, prompts[:B], params)
            SECONDS.clear()
            engine = serving.queue(llm, prompts, params)
            steps, t = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            seconds = time.perf_counter() - t
            print(f"{name}: {steps} steps, {1e3 * seconds / steps:.2f} ms/step, {len(prompts) * 16 / seconds:.0f} "
                  "tokens/s")
            for key, value in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
                print(f"    {key:15s} {1e3 * value / steps:8.2f} ms/step")
            del llm, engine


if __name__ == "__main__":
    main()
