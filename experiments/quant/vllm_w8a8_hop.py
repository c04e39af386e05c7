"""The demo's trained hop TaH2 in vLLM (CPU): float32 vs its W8A8 int8 export, greedy, on held-out hop problems.

    .venv-vllm/bin/python experiments/quant/vllm_w8a8_hop.py [CHECKPOINT] [WORKDIR]   (after make demo)
"""
import os, sys, tempfile, gc, shutil, re
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1"); os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO]
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import hf_loops
from hf_loops.core.w8a8 import save_w8a8_int8
from hf_loops.evaluation.tasks import hop_task_run
src = sys.argv[1] if len(sys.argv) > 1 else "demo_out/hop/tah2-seed0"
q = sys.argv[2] if len(sys.argv) > 2 else os.path.join(tempfile.mkdtemp(prefix="w8a8_hop_"), "model")
shutil.rmtree(q, ignore_errors=True)
tok = AutoTokenizer.from_pretrained(src)
save_w8a8_int8(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), q, tokenizer=tok)
run = hop_task_run(200, 1, split="test")
rows = run.rows()
ex = run.examples(rows)
prompts = [tok(tok.apply_chat_template(e.prompt, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"] for e in ex]
import vllm
from vllm.inputs import TokensPrompt
res = {}
for name, path in (("fp", src), ("q", q)):
    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=32, seed=0)
    llm.apply_model(lambda m: m.depth_statistics(reset=True))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], vllm.SamplingParams(temperature=0, max_tokens=run.max_new_tokens()), use_tqdm=False)
    st = llm.apply_model(lambda m: m.depth_statistics())[0]
    texts = [o.outputs[0].text for o in outs]
    em = sum(t.strip() == r["answer"].strip() for t, r in zip(texts, rows)) / len(rows)
    res[name] = (texts, [list(o.outputs[0].token_ids) for o in outs], st)
    print(name, "exact match", em, "depth", st["mean_depth"], st["tokens_per_depth"], texts[0], "|", rows[0]["answer"], flush=True)
    del llm; gc.collect()
a, b = res["fp"][1], res["q"][1]
print("identical outputs", sum(x == y for x, y in zip(a, b)), "of", len(a))
