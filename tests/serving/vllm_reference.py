"""Reference side of the vLLM tests, run in the vLLM environment itself (under vLLM's transformers): builds a tiny
random TaH2 (or SGT), saves it with the embedded base's tokenizer, and writes our HF `generate`'s greedy tokens (fp32)
for the given prompts, plus (TaH2) every prompt's per-token executed depths.

    python tests/serving/vllm_reference.py SPECS.json OUT_DIR
    python tests/serving/vllm_reference.py --score MODEL_DIR SEQUENCES.json OUT.json
    python tests/serving/vllm_reference.py --depths MODEL_DIR SEQUENCES.json OUT.json

    python tests/serving/vllm_reference.py --time MODEL_DIR PROMPTS.json NEW_TOKENS ROUNDS

--time: best seconds of a greedy HF `generate` call on the prompts, for NEW_TOKENS and for one token (the vLLM bench). --score: teacher-forced log q of given continuations ([{"prompt": [ids], "tokens": [ids]}] → [[log q per token]]). --depths: the executed depth of
every token vLLM feeds the model for such a continuation (the prompt and all its tokens but the last).

SPECS: {name: {"seed": int, "arch": "tah2" (default) | "sgt", "<arch>": {config overrides}, "prompts": [[token ids]], "max_new_tokens": int}}; each
name gets OUT_DIR/name/model (the export) and OUT_DIR/name/expected.json (tokens, prompt_depths). Optional keys
(the vLLM bench): "qwen" (Qwen3 config overrides), "decider_std" (score weights' std, default 3), "save_base" (also
save the Qwen3 the TaH2 was converted from, to OUT_DIR/name/base).
"""

import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [REPO]

# head_dim 32: the smallest head size vLLM's CPU attention kernel takes; vocabulary of the embedded base's tokenizer
QWEN = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=2, bos_token_id=0)


def build(spec: dict, out_dir: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_loops.conversion import convert_qwen3

    seed = spec.get("seed", 0)
    torch.manual_seed(seed)
    qwen = Qwen3ForCausalLM(Qwen3Config(**dict(QWEN, **spec.get("qwen", {})))).eval()
    with torch.no_grad():  # a sharper next-token distribution: greedy argmax far from ties
        qwen.lm_head.weight.mul_(4.0)
    arch = spec.get("arch", "tah2")
    model = convert_qwen3(qwen, arch, **spec.get(arch, {})).eval()
    if getattr(model, "decider", None) is not None:  # g far from τ: float noise between two exact computations cannot flip a decision
        with torch.no_grad():
            torch.manual_seed(seed + 1)
            model.decider.score.weight.normal_(0.0, spec.get("decider_std", 3.0))
    if spec.get("save_base"):
        qwen.save_pretrained(os.path.join(out_dir, "base"))
        copy_tokenizer(os.path.join(out_dir, "base"))
    return model


def copy_tokenizer(model_dir: str) -> None:
    base = os.path.join(REPO, "hf_loops", "data", "base")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(base, name), model_dir)


def main(spec_path: str, out_root: str) -> None:
    with open(spec_path) as f:
        specs = json.load(f)
    for name, spec in specs.items():
        reference(spec, os.path.join(out_root, name))


def reference(spec: dict, out_dir: str) -> None:
    model = build(spec, out_dir)
    arch = spec.get("arch", "tah2")
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir)
    copy_tokenizer(model_dir)
    model.generation_config.eos_token_id = None  # fixed-length outputs (vLLM side: ignore_eos)
    outputs, logprobs, prompt_depths, sequence_depths, no_loop_tokens = [], [], [], [], []
    with torch.no_grad():
        for ids in spec["prompts"]:
            x = torch.tensor([ids])
            out = model.generate(x, max_new_tokens=spec["max_new_tokens"], do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            outputs.append(tokens)
            # scores = the mixture's log-probabilities log q (no logits processor under greedy decoding)
            # (log_softmax: SGT's scores are raw logits; for TaH2 it leaves log q as it is)
            logprobs.append([float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in
                             zip(out.scores, tokens, strict=False)])
            if arch == "sgt":  # static loops, no per-token depth; the tokens without the loops (they must differ)
                no_loop_tokens.append(generate_without_loops(model, x, spec["max_new_tokens"]))
                continue
            prompt_depths.append(model(x, use_cache=False).iter_counts[0].tolist())
            # depths of every token vLLM feeds the model: the prompt and all generated tokens but the last
            fed = torch.tensor([ids + tokens[:-1]])
            sequence_depths.append(model(fed, use_cache=False).iter_counts[0].tolist())
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump({"tokens": outputs, "logprobs": logprobs, "prompt_depths": prompt_depths,
                   "sequence_depths": sequence_depths, "no_loop_tokens": no_loop_tokens}, f)


def generate_without_loops(model, x, max_new_tokens):
    """SGT's greedy tokens with every loop switched off (the plain Qwen3 it was converted from)."""
    layers = model.model.layers
    saved = [(layer.loop_heads, layer.loop_depth) for layer in layers]
    block = model.config.block_loop_depth
    for layer in layers:
        layer.loop_depth = 0
    model.config.block_loop_depth = 0
    try:
        out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    finally:
        for layer, (heads, depth) in zip(layers, saved, strict=True):
            layer.loop_heads, layer.loop_depth = heads, depth
        model.config.block_loop_depth = block
    return out[0, x.shape[1]:].tolist()


def score(model_dir: str, sequences_path: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    import hf_loops  # noqa: F401  (registers TaH2 with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(sequences_path) as f:
        sequences = json.load(f)
    out = []
    with torch.no_grad():
        for seq in sequences:
            prompt, tokens = seq["prompt"], seq["tokens"]
            log_q = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0]  # mixture log q, every position
            out.append([float(log_q[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)])
    with open(out_path, "w") as f:
        json.dump(out, f)


def depths(model_dir: str, sequences_path: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    import hf_loops  # noqa: F401  (registers TaH2 with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(sequences_path) as f:
        sequences = json.load(f)
    with torch.no_grad():
        out = [model(torch.tensor([seq["prompt"] + seq["tokens"][:-1]]), use_cache=False).iter_counts[0].tolist()
               for seq in sequences]
    with open(out_path, "w") as f:
        json.dump(out, f)


def time_generate(model_dir: str, prompts_path: str, new: str, rounds: str) -> None:
    """Prints the best-of-`rounds` seconds of one greedy `generate` call on the given equal-length prompts for `new`
    tokens and for one token (the prefill), the two alternating, after a warm-up: the HF side of the vLLM bench."""
    import time

    from transformers import AutoModelForCausalLM

    import hf_loops  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with open(prompts_path) as f:
        ids = torch.tensor(json.load(f))
    best = {int(new): float("inf"), 1: float("inf")}
    with torch.no_grad():
        for i in range(int(rounds) + 1):
            for n in best:
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
                if i:
                    best[n] = min(best[n], time.perf_counter() - t)
    print(best[int(new)], best[1])


if __name__ == "__main__":
    if sys.argv[1] == "--score":
        score(*sys.argv[2:5])
    elif sys.argv[1] == "--depths":
        depths(*sys.argv[2:5])
    elif sys.argv[1] == "--time":
        time_generate(*sys.argv[2:6])
    else:
        main(sys.argv[1], sys.argv[2])
