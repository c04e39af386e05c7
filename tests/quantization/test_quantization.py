"""Weight-only int8 / int4 of TaH2, SpiralFormer and SGT through `from_pretrained(..., quantization_config=...)`
(`hf_loops.core.quantization`): the fast CPU kernels agree with torchao's own linear, the module policy, generate,
save → reload, remote-code export, LoRA on the int8 base, and the per-depth calibration inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchao", reason='torchao is not installed (pip install -e ".[quant]")')

from transformers import AutoModelForCausalLM

from hf_loops.core import quantization as Q
from tests.helpers.looped_tiny_configs import tiny_causal_lm

ARCHS = ("tah2_m2", "spiralformer", "sgt")
GROUP = 32  # the tiny models' hidden size is 32 (the CPU int4 kernel takes groups of 32, 64, 128)
IDS = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def _saved(tmp_path, arch: str, **overrides) -> str:
    model = tiny_causal_lm(arch, dtype=torch.float32, **overrides)
    path = str(tmp_path / f"{arch}-fp32")
    model.save_pretrained(path)
    return path


def _load(path: str, scheme: str | None, **kw):
    extra = {} if scheme is None else {"quantization_config": Q.quantization_config(scheme, path, group_size=GROUP,
                                                                                     **kw)}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def _greedy(model, ids=IDS, n=5):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_fast_cpu_kernel_matches_torchao_linear(scheme):
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(3, 5, 256)
    quantize_(layer, Q._ao_config(scheme, 64))
    Q.disable_cpu_kernels()
    with torch.no_grad():
        reference = layer(x)  # torchao's own: dequantize, float32 matmul
        Q.enable_cpu_kernels()
        fast = layer(x)
    assert Q.cpu_kernels_enabled() and fast.dtype == x.dtype and fast.shape == reference.shape
    # bfloat16 activations: relative error of a 256-term dot product of bf16-rounded inputs
    assert ((fast - reference).norm() / reference.norm()).item() < 1e-2
    # autograd through the input falls back to torchao's own linear (torch's packed kernels have no backward)
    xg = x.clone().requires_grad_(True)
    layer(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_module_policy_per_architecture():
    from hf_loops import SGTConfig, SpiralFormerConfig, TaH2Config

    assert Q.kept_modules(TaH2Config(tie_word_embeddings=False)) == ["decider", "updater"]
    assert Q.kept_modules(TaH2Config(tie_word_embeddings=True)) == ["decider", "updater", "lm_head"]
    assert Q.kept_modules(TaH2Config(tie_word_embeddings=False), keep_loop_control=False) == []
    assert Q.kept_modules(SpiralFormerConfig(tie_word_embeddings=False)) == [
        "model.scorers", "model.allocators", "model.routers"]
    assert Q.kept_modules(SGTConfig(tie_word_embeddings=False), quantize_lm_head=False) == ["lm_head"]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", Q.SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_load_generate_save_reload(tmp_path, arch, scheme):
    path = _saved(tmp_path, arch)
    fp32 = _load(path, None)
    model = _load(path, scheme)
    quantized = Q.quantized_linears(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = Q.kept_modules(model)
    expected = [n for n in linears if not any(n == k or n.startswith(k + ".") for k in kept)]
    assert sorted(quantized) == sorted(expected) and "lm_head" in quantized
    assert all(not type(model.get_submodule(n).weight).__module__.startswith("torchao") for n in set(linears) - set(quantized))
    want = {"int8": "Int8Tensor", "int4": "IntxUnpackedToInt8Tensor"}[scheme]
    assert set(quantized.values()) == {want}

    with torch.no_grad():
        logits, ref = model(IDS).logits, fp32(IDS).logits
    assert torch.isfinite(logits).all()
    tol = {"int8": 0.05, "int4": 0.3}[scheme]
    assert ((logits - ref).norm() / ref.norm()).item() < tol

    greedy = _greedy(model)
    assert greedy.shape == (2, IDS.shape[1] + 5)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=5, do_sample=True,
                                 top_k=20, pad_token_id=0)
    assert sampled.shape == greedy.shape

    out = tmp_path / f"{arch}-{scheme}"
    model.save_pretrained(out)
    config = json.load(open(out / "config.json"))
    assert config["quantization_config"]["quant_method"] == "torchao"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert Q.quantized_linears(reloaded) == quantized
    assert torch.equal(_greedy(reloaded), greedy)
    fp32_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    assert os.path.getsize(out / "model.safetensors") < fp32_bytes


@pytest.mark.slow
def test_tah2_depths_kept_by_the_policy(tmp_path):
    """The decider and updater stay float32 under the policy; the executed depths of a quantized TaH2 are those
    of float32 on nearly every token (the tiny model has widened decider weights, so g is far from τ)."""
    path = _saved(tmp_path, "tah2_m2")
    fp32 = _load(path, None)
    model = _load(path, "int8")
    assert type(model.decider.score.weight) is torch.nn.Parameter and model.decider.score.weight.dtype == torch.float32
    assert "decider.score" not in Q.quantized_linears(model) and "updater.projection" not in Q.quantized_linears(model)
    ids = torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        d_ref, d_q = fp32(ids).iter_counts, model(ids).iter_counts
    assert (d_ref == d_q).float().mean().item() >= 0.9


CHILD = """
import sys, torch
from transformers import AutoModelForCausalLM
assert "hf_loops" not in sys.modules
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
assert "hf_loops" not in sys.modules, "remote code imported hf_loops"
assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
ids = torch.load(sys.argv[2])
with torch.no_grad():
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
torch.save(gen, sys.argv[3])
"""


@pytest.mark.slow
def test_quantized_export_loads_with_remote_code(tmp_path):
    from hf_loops.conversion import export

    path = _saved(tmp_path, "tah2_m2")
    model = _load(path, "int8")
    out_dir = export(model, tmp_path / "exported", model_card=False)
    assert "modeling_tah2.py" in os.listdir(out_dir)
    torch.save(IDS, tmp_path / "ids.pt")
    Q.disable_cpu_kernels()  # the child runs torchao's own linear (no hf_loops there): compare with the same
    try:
        want = _greedy(model)
    finally:
        Q.enable_cpu_kernels()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH", None)
    res = subprocess.run([sys.executable, str(script), out_dir, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


@pytest.mark.slow
def test_lora_on_int8_base_trains_and_merges(tmp_path):
    peft = pytest.importorskip("peft")
    path = _saved(tmp_path, "tah2_m2")
    model = _load(path, "int8")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      exclude_modules=r".*(decider|updater).*", lora_dropout=0.0))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(3, 97, (4, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    lora.train()
    for _ in range(8):
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    lora.eval()
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()
        got = merged(input_ids=ids).logits
    kind = type(merged.model.layers[0].mlp.up_proj.weight).__name__
    print("merged weight:", kind, "max |Δlogit|:", (got - want).abs().max().item())
    assert ((got - want).norm() / want.norm()).item() < 0.05


@pytest.mark.slow
def test_calibration_inputs_cover_every_depth(tmp_path):
    """TaH2 M = 2 calls each shared linear once per depth: depth 1 on every token, depth 2 on the tokens that
    continue. A first-depth-only statistic differs from the one over every executed depth."""
    model = tiny_causal_lm("tah2_m2", dtype=torch.float32)
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        depths = model(ids).iter_counts
    continuing = int((depths >= 2).sum())
    assert 0 < continuing < depths.numel()
    found = Q.collect_depth_inputs(model, [{"input_ids": ids}])
    assert not any(k.startswith(("decider", "updater")) for k in found)
    calls = found["model.layers.0.mlp.up_proj"]
    assert len(calls) == 2 and calls[0].shape[0] == ids.numel()
    assert continuing <= calls[1].shape[0] < ids.numel()  # the rows of the depth-2 pass (the continuing tokens')
    per_depth = torch.cat(calls)
    first = calls[0]
    # the second-moment (GPTQ Hessian-style) statistics of depth 1 alone and of every depth disagree
    h_first = first.T @ first / first.shape[0]
    h_all = per_depth.T @ per_depth / per_depth.shape[0]
    assert ((h_all - h_first).norm() / h_first.norm()).item() > 0.05
    assert len(found["lm_head"]) == 2  # the decider reads the logits of every depth
