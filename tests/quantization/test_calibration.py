"""GPTQ-style calibration whose Hessians see every executed depth (`hf_loops.core.calibration`): the algorithm on
hand-checkable cases (identity Hessian = round-to-nearest, lower output error than round-to-nearest on correlated
inputs), the depth statistics of a looped model (every call vs the first), the difference they make on the deeper
passes, and the quantized model's ordinary life afterwards (fast kernels, save -> reload, greedy tokens)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao", reason='torchao is not installed (pip install -e ".[quant]")')

from transformers import AutoModelForCausalLM

from hf_loops.core import calibration as C
from hf_loops.core import quantization as Q
from tests.helpers.looped_tiny_configs import tiny_causal_lm

GROUP = 32


def _rtn(weight: torch.Tensor, scheme: str):
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data.copy_(weight)
    holder = torch.nn.Sequential(lin)
    quantize_(holder, Q._ao_config(scheme, GROUP))
    return holder[0].weight


def _correlated(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k) * 0.3
    return torch.randn(n, k, generator=g) @ mix * torch.linspace(0.2, 3.0, k)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_identity_hessian_gives_round_to_nearest(scheme):
    """With uncorrelated unit inputs (H = I) no error is fed forward: GPTQ picks torchao's own rounding."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    rtn = _rtn(w, scheme)
    scale, zero, group, lo, hi = C._grid(rtn)
    q = C.gptq_columns(w, torch.eye(64, dtype=torch.float64), scale, zero, group, lo, hi, damp=0.0)
    assert torch.equal(q.to(rtn.qdata.dtype), rtn.qdata)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_lowers_the_output_error_of_round_to_nearest(scheme, seed):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed + 10))
    x = _correlated(512, 64, seed)
    rtn = _rtn(w, scheme)
    scale, zero, group, lo, hi = C._grid(rtn)
    q = C.gptq_columns(w, (x.T @ x).to(torch.float64), scale, zero, group, lo, hi)
    deq = (q.to(torch.float64) - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)
    assert q.min() >= lo and q.max() <= hi
    err_gptq = (x.double() @ (w.double() - deq).T).norm()
    err_rtn = (x.double() @ (w.double() - rtn.dequantize().double()).T).norm()
    assert err_gptq < 0.9 * err_rtn, (err_gptq, err_rtn)


def _tah2_and_batches():
    model = tiny_causal_lm("tah2_m2", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(3, 97, (4, 24), generator=g)} for _ in range(4)]
    return model, batches


def _saved_tah2(tmp_path):
    model, batches = _tah2_and_batches()
    path = str(tmp_path / "tah2-fp32")
    model.save_pretrained(path)
    return path, model, batches


def test_hessians_count_every_executed_depth_or_the_first():
    model, batches = _tah2_and_batches()
    with torch.no_grad():
        depths = torch.cat([model(**b).iter_counts.reshape(-1) for b in batches])
    tokens, continuing = depths.numel(), int((depths >= 2).sum())
    assert 0 < continuing < tokens
    every = C.linear_hessians(model, batches, "all")
    first = C.linear_hessians(model, batches, "first")
    assert not any(n.startswith(("decider", "updater")) for n in every)
    name = "model.layers.0.mlp.up_proj"
    assert every[name]["calls"] == 2 * len(batches) and first[name]["calls"] == len(batches)
    assert first[name]["rows"] == tokens
    assert tokens + continuing <= every[name]["rows"] < 2 * tokens  # depth 2 runs the continuing tokens' rows
    diff = (every[name]["H"] / every[name]["rows"] - first[name]["H"] / first[name]["rows"]).norm()
    assert diff / (first[name]["H"] / first[name]["rows"]).norm() > 0.05


def _depth_inputs(model, batches, name):
    calls = Q.collect_depth_inputs(model, batches, [name])[name]
    return torch.cat(calls[0::2]), torch.cat(calls[1::2])  # depth-1 rows, depth-2 rows (one pair per batch)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_all_depth_calibration_fits_the_deeper_pass_better(scheme, tmp_path):
    """The shared linears' quantization error on the depth-2 inputs: smaller when the Hessian saw depth 2. Summed
    over the linears of the block, on held-out batches."""
    path, model, batches = _saved_tah2(tmp_path)
    held_out = [{"input_ids": torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(9))}]
    names = [n for n in Q.quantizable_linears(model) if n.startswith("model.layers.")]
    floats = {n: model.get_submodule(n).weight.detach().double().clone() for n in names}
    inputs = {n: _depth_inputs(model, held_out, n) for n in names}

    def depth_errors(iterations):
        m, _ = C.gptq_quantize(path, batches, scheme, iterations=iterations, group_size=GROUP)
        out = torch.zeros(2, dtype=torch.float64)
        for n in names:
            deq = m.get_submodule(n).weight.dequantize().double()
            for d, x in enumerate(inputs[n]):
                out[d] += ((x.double() @ (floats[n] - deq).T).norm() ** 2).item()
        return out

    every, first = depth_errors("all"), depth_errors("first")
    print(scheme, "squared error on depth-1 / depth-2 inputs: all", every.tolist(), "first", first.tolist())
    assert every[1] < first[1], (every, first)  # depth 2: better with its statistics
    assert every.sum() < first.sum()


def test_calibrated_model_runs_the_fast_kernels_and_round_trips(tmp_path):
    path, _, batches = _saved_tah2(tmp_path)
    model, report = C.gptq_quantize(path, batches, "int8")
    assert report["linears"] == len(Q.quantized_linears(model)) > 0
    assert report["calls_per_pass"]["model.layers.0.self_attn.q_proj"] == 2.0
    ids = batches[0]["input_ids"][:2, :7]
    with torch.no_grad():
        Q.disable_cpu_kernels()
        slow = model(ids).logits
        Q.enable_cpu_kernels()
        fast = model(ids).logits
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                              pad_token_id=0)
    assert ((fast - slow).norm() / slow.norm()).item() < 2e-2  # bf16 activations in the packed kernel
    model.save_pretrained(tmp_path / "gptq")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "gptq", dtype=torch.float32).eval()
    Q.enable_cpu_kernels()
    for name in Q.quantized_linears(model):
        assert torch.equal(back.get_submodule(name).weight.qdata, model.get_submodule(name).weight.qdata)
    with torch.no_grad():
        got = back.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                            pad_token_id=0)
    assert torch.equal(got, want)


def test_bad_settings_are_one_clear_error(tmp_path):
    path, model, batches = _saved_tah2(tmp_path)
    with pytest.raises(ValueError, match="iterations must be one of"):
        C.linear_hessians(model, batches, "last")
    with pytest.raises(ValueError, match=r"damp must be in \[0, 1\)"):
        C.gptq_quantize(path, batches, damp=1.5)
    with pytest.raises(ValueError, match="give at least one batch"):
        C.linear_hessians(model, [])
    with pytest.raises(ValueError, match="scheme must be one of"):
        C.gptq_quantize(path, batches, "int3")
