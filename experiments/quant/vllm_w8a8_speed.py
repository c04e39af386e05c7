"""Tokens/s of a W8A8 int8 TaH2 vs float32 in vLLM's CPU build (one thread), same weights, decode.

    .venv-vllm/bin/python experiments/quant/vllm_w8a8_speed.py BATCH [WORKDIR]
"""
import os, sys, tempfile, time, gc, shutil
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("OMP_NUM_THREADS", "1"); os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "tests", "serving"), REPO]
import torch
import vllm_reference as R
from hf_loops.core.w8a8 import save_w8a8_int8
root = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="w8a8_speed_")
shutil.rmtree(root, ignore_errors=True); os.makedirs(root)
qwen = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64)
model = R.build({"seed": 0, "tah2": {"max_iterations": 2}, "qwen": qwen}, root)
model.save_pretrained(root + "/fp"); R.copy_tokenizer(root + "/fp")
save_w8a8_int8(model, root + "/q"); R.copy_tokenizer(root + "/q")
def size(d): return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
print("bytes", size(root + "/q") / size(root + "/fp"))
import vllm
from vllm.inputs import TokensPrompt
import random
rng = random.Random(0)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
prompts = [[rng.randrange(3, 8000) for _ in range(32)] for _ in range(B)]
res = {}
for name in ("fp", "q"):
    llm = vllm.LLM(model=root + "/" + name, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=B, seed=0)
    p1 = vllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pn = vllm.SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(tp, pn, use_tqdm=False)
    best = []
    for _ in range(3):
        t0 = time.perf_counter(); llm.generate(tp, p1, use_tqdm=False); t1 = time.perf_counter()
        llm.apply_model(lambda m: m.depth_statistics(reset=True))
        outs = llm.generate(tp, pn, use_tqdm=False); t2 = time.perf_counter()
        best.append((t2 - t1) - (t1 - t0))
    st = llm.apply_model(lambda m: m.depth_statistics())[0]
    res[name] = (min(best), best, st["mean_depth"], [list(o.outputs[0].token_ids) for o in outs])
    print(name, res[name][:3], flush=True)
    del llm; gc.collect()
print("decode tokens/s q / fp:", res["fp"][0] / res["q"][0])
a, b = res["fp"][3], res["q"][3]
print("greedy agreement:", sum(x == y for r, s in zip(a, b) for x, y in zip(r, s)) / sum(map(len, a)))
first = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), len(r)) for r, s in zip(a, b)]
print("tokens before the first divergence:", first)
