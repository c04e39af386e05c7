"""The paper's remaining TaH2 baselines (spec §5): Huginn-style prelude/core/coda with the Eq. 12 adapter, and Ouro
Stage II (linear exit gate, soft-target gate loss, Q-exit, `exit_kv_fill="copy_last"`)."""

import math

import pytest
import torch
from helpers.tah2_helpers import tiny_qwen3

from hf_loops import TAH2_PRESETS, TaH2Config
from hf_loops.conversion import convert_qwen3
from hf_loops.core.flops_tah2 import per_call_flops
from hf_loops.training.tah2_labels import ouro_gate_loss_sum, ouro_gate_targets


def _huginn(M=3, layers=4, **kw):
    return convert_qwen3(tiny_qwen3(0, num_hidden_layers=layers), "tah2",
                         **{**TAH2_PRESETS["huginn"], "max_iterations": M, **kw}).eval()


def _ouro(M=3, layers=2):
    return convert_qwen3(tiny_qwen3(0, num_hidden_layers=layers), "tah2",
                         **{**TAH2_PRESETS["ouro-stage2"], "max_iterations": M}).eval()


def _batch(seed=0, B=3, T=9):
    ids = torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[B - 1, :1] = 0
    return ids, mask


def _decode(model, ids, mask, split):
    """Teacher-forced logits from a prefill of `split` tokens, then one cached step per token."""
    with torch.no_grad():
        out = model(ids[:, :split], attention_mask=mask[:, :split], use_cache=True)
        cache, steps = out.cache, [out.logits[:, -1]]
        for t in range(split, ids.shape[1]):
            o = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = o.cache
            steps.append(o.logits[:, -1])
    return torch.stack(steps, 1), cache


# ----------------------------------------------------------------------------------------------------------------------
# Huginn-style
# ----------------------------------------------------------------------------------------------------------------------


def test_huginn_span_defaults_to_the_papers_middle_layers_scaled():
    assert TaH2Config(num_hidden_layers=28, **TAH2_PRESETS["huginn"]).loop_span == [7, 21]
    assert TaH2Config(num_hidden_layers=4, **TAH2_PRESETS["huginn"]).loop_span == [1, 3]
    with pytest.raises(ValueError, match="loop_span must be"):
        TaH2Config(num_hidden_layers=4, **{**TAH2_PRESETS["huginn"], "loop_span": [3, 9]})
    with pytest.raises(ValueError, match="needs"):
        TaH2Config(num_hidden_layers=4, **{**TAH2_PRESETS["huginn"], "iteration_attention": "duo"})


def test_huginn_prelude_and_coda_run_once_and_the_core_m_times():
    model = _huginn(M=3, layers=4)
    calls = [0] * 4
    hooks = [layer.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(model.model.layers)]
    ids, mask = _batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    assert model.config.loop_span == [1, 3]
    assert calls == [1, 3, 3, 1]
    assert out.iter_counts.tolist() == (mask * 3).tolist()


def test_huginn_adapter_has_d2_plus_2d_parameters_costs_2d2_and_starts_as_the_spec_says():
    model = _huginn()
    d = model.config.hidden_size
    assert sum(p.numel() for p in model.core_adapter.parameters()) == d * d + 2 * d
    assert per_call_flops(model.config).huginn_adapter == 2 * d * d
    r, z = torch.randn(2, 5, d), torch.randn(2, 5, d)
    with torch.no_grad():  # W_in = I, b_in = b_ret = 0: u = exp(-ln 2) r + ln 2 · z = r/2 + ln2 · z
        torch.testing.assert_close(model.core_adapter(r, z), 0.5 * r + math.log(2.0) * z)


def test_huginn_with_one_iteration_is_qwen3():
    q = tiny_qwen3(0, num_hidden_layers=4)
    model = convert_qwen3(q, "tah2", **{**TAH2_PRESETS["huginn"], "max_iterations": 1}).eval()
    ids, _ = _batch()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, q(ids).logits)


def test_huginn_cache_equals_no_cache_left_padding_equals_rows_and_generate_works():
    model = _huginn(M=3)
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    stepped, _ = _decode(model, ids, mask, split=5)
    torch.testing.assert_close(stepped, full[:, 4:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            alone = model(ids[b:b + 1, real]).logits[0]
            torch.testing.assert_close(full[b, real], alone, atol=1e-5, rtol=1e-5)
        g1 = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        g2 = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)
    assert torch.equal(g1, g2) and beams.shape == (3, 12)


# ----------------------------------------------------------------------------------------------------------------------
# Ouro Stage II
# ----------------------------------------------------------------------------------------------------------------------


def _script_exit(model, lambdas_by_depth):
    """λ(m) per token from `lambdas_by_depth[m-1](embeds)`; returns the continue logit logit(1 − λ)."""
    state = {"depth": 0}
    forward = type(model).forward.__get__(model)

    def reset(*a, **kw):
        state["depth"] = 0
        return forward(*a, **kw)

    def continue_logit(embeds, hidden, logits):
        state["depth"] += 1
        lam = lambdas_by_depth[state["depth"] - 1](embeds)
        return torch.logit(1.0 - lam.float())

    model.forward = reset
    model._continue_logit = continue_logit


def test_q_exit_outputs_the_first_depth_whose_cumulative_exit_probability_reaches_q():
    """q = 0.5, M = 3. Token kinds by the sign of two embedding coordinates:
    λ = (0.3, 0.4): survival 0.7 then 0.42 ≤ 0.5 → exits at depth 2;  λ = (0.6, ·): 0.4 → depth 1;
    λ = (0.1, 0.1): 0.9, 0.81 → runs to M = 3."""
    model = _ouro(M=3)
    kind = lambda e: (e[:, 0] > 0).long() + 2 * (e[:, 1] > 0).long()  # noqa: E731

    def lam(values):
        return lambda e: torch.tensor(values, dtype=torch.float32)[kind(e).clamp(max=2)]

    _script_exit(model, [lam([0.3, 0.6, 0.1]), lam([0.4, 0.5, 0.1])])
    ids, mask = _batch(seed=3)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    k = kind(model.model.embed_tokens(ids).reshape(-1, model.config.hidden_size)).clamp(max=2).view(ids.shape)
    expected = torch.tensor([2, 1, 3])[k] * mask
    assert torch.equal(out.iter_counts, expected)
    # the output at each token is its exit depth's own distribution
    for b, t in mask.nonzero().tolist():
        depth = int(expected[b, t])
        h = out.iteration_hidden_states[depth - 1][b, t]
        torch.testing.assert_close(out.logits[b, t], torch.log_softmax(model.lm_head(h).float(), -1))


def test_copy_last_gives_an_exited_decode_token_its_exit_depth_kv_in_every_deeper_stream():
    model = _ouro(M=3)
    exit_now = lambda e: torch.where(e[:, 0] > 0, 0.9, 0.05)  # noqa: E731  (λ ≥ 0.5 at depth 1: exit)
    _script_exit(model, [exit_now, lambda e: torch.full(e.shape[:1], 0.05)])
    ids, mask = _batch(seed=4, B=2, T=7)
    _, cache = _decode(model, ids, mask, split=4)
    L = model.config.num_hidden_layers
    exited = model.model.embed_tokens(ids)[..., 0] > 0
    for layer in range(L):
        k0 = cache.layers[cache.kv_slot(0, layer)].keys
        for stream in (1, 2):
            k = cache.layers[cache.kv_slot(stream, layer)].keys
            assert k.shape == k0.shape  # dense: every token in every stream
            same = (k - k0).abs().amax(dim=(1, 3)) == 0  # (B, T)
            real = mask.bool()
            assert torch.equal(same[real], exited[real]), (layer, stream)


def test_ouro_cache_equals_no_cache_and_left_padding_equals_rows():
    model = _ouro(M=3)
    with torch.no_grad():
        model.decider.gate.weight.normal_(0.0, 2.0)  # mixed exit depths
    ids, mask = _batch(seed=5)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
    assert len(set(full.iter_counts[mask.bool()].tolist())) > 1
    stepped, _ = _decode(model, ids, mask, split=5)
    torch.testing.assert_close(stepped, full.logits[:, 4:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            alone = model(ids[b:b + 1, real])
            assert torch.equal(alone.iter_counts[0], full.iter_counts[b, real])
            torch.testing.assert_close(alone.logits[0], full.logits[b, real], atol=1e-5, rtol=1e-5)
        g1 = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        g2 = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(g1, g2)


def test_ouro_gate_soft_targets_and_loss_on_a_hand_example():
    # I = max(0, ℓ(m) − ℓ(m+1)): 0.1 → σ(50 · 0.095); a loss that grows → I = 0 → σ(−0.25)
    t = ouro_gate_targets(torch.tensor([2.0, 1.0]), torch.tensor([1.9, 1.2]))
    torch.testing.assert_close(t, torch.sigmoid(torch.tensor([50 * 0.095, -0.25])))

    class Rec:  # one row, two supervised tokens, M = 2
        max_iterations = 2
        targets = torch.tensor([[5, 6]])
        executed = [torch.ones(1, 2, dtype=torch.bool)] * 2
        token_logprob = [torch.tensor([[-2.0, -1.0]]), torch.tensor([[-1.9, -1.2]])]
        decider_logits = [torch.tensor([[0.3, -0.4]])]

    bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor([0.3, -0.4]), t, reduction="sum")
    torch.testing.assert_close(ouro_gate_loss_sum(Rec), bce / 2)


def test_ouro_stage2_training_moves_only_the_gate(tmp_path):
    from hf_loops.training.tah2_trainer import TaH2SFTConfig, metric_values, tah2_joint_loss

    model = _ouro(M=2).train()
    args = TaH2SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    ids, mask = _batch(seed=6)
    loss, out, metrics = tah2_joint_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, args)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert set(grads) == {"decider.gate.weight"}
    assert metric_values(metrics)["gate_loss"] > 0 and torch.isfinite(loss)


# ----------------------------------------------------------------------------------------------------------------------
# Through `hf-loops train`: a few CPU steps, save, load with and without hf_loops, generate
# ----------------------------------------------------------------------------------------------------------------------

from helpers.train_cli_helpers import _argv, tiny_train_setup  # noqa: E402,F401  (the `data` fixture)

CHILD = """
import sys
sys.modules["hf_loops"] = None  # hf_loops cannot be imported in this process
import torch
from transformers import AutoModelForCausalLM
ids = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(ids).logits, path + "/remote_logits.pt")
"""


@pytest.mark.slow
def test_both_baselines_train_save_load_by_remote_code_and_generate(data, tmp_path):
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from hf_loops.training.train_tah2 import run as train_run

    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    want, outs = {}, []
    for arch, decider in (("huginn", "always"), ("ouro-stage2", "exit_gate")):
        out = tmp_path / arch
        trainer = train_run(_argv(data, out, arch=arch))
        assert trainer.state.global_step == 2
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(model).__name__ == "TaH2ForCausalLM" and model.config.decider == decider
        with torch.no_grad():
            want[arch] = model(ids).logits
            gen = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert gen.shape[1] == 9 or model.config.eos_token_id in gen[0, 6:].tolist()
        outs.append(str(out))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ids.pt"), *outs], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for arch in want:
        assert (torch.load(tmp_path / arch / "remote_logits.pt") - want[arch]).abs().max() <= 1e-5
