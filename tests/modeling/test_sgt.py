"""SGT model: config validation, Qwen3 exactness, the looping equation, sliced == masked, KV cache, generation,
entropy probe, save/load, remote code, Block Loop baseline, FLOPs (spec: shared/specs/sgt.md §12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache

import hf_loops  # noqa: F401  (registers the Auto classes)
from hf_loops import SGTConfig, SGTForCausalLM
from hf_loops.conversion.export import export
from hf_loops.core.flops_sgt import (
    block_loop_overhead,
    loop_flops_per_token,
    parameters_of_config,
    plan_overhead,
    sgt_overhead,
    training_overhead,
)
from hf_loops.modeling.modeling_sgt import attention_row_entropy

VOCAB = 97


BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
MHA = dict(BASE, num_key_value_heads=4)
PLAN = [{"layer": 1, "heads": [0, 3], "depth": 2}, {"layer": 2, "heads": [1], "depth": 1}]


def make(plan=None, seed=0, **over) -> SGTForCausalLM:
    torch.manual_seed(seed)
    return SGTForCausalLM(SGTConfig(**{**BASE, **over}, loop_plan=plan)).eval()


def with_plan(model, plan, **over) -> SGTForCausalLM:
    """A model with `plan` and the same weights as `model`."""
    cfg = {**model.config.to_dict(), **over, "loop_plan": plan}
    for k in ("model_type", "architectures", "transformers_version"):
        cfg.pop(k, None)
    other = SGTForCausalLM(SGTConfig(**cfg)).eval()
    other.load_state_dict(model.state_dict())
    return other


def ids(batch=2, length=10, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over, field",
    [
        ({"loop_plan": [{"layer": 1, "heads": [4], "depth": 1}]}, "head index"),
        ({"loop_plan": [{"layer": 1, "heads": [-1], "depth": 1}]}, "head index"),
        ({"loop_plan": [{"layer": 3, "heads": [0], "depth": 1}]}, "layer must be in"),
        ({"loop_plan": [{"layer": 1, "heads": [0], "depth": -1}]}, "depth"),
        ({"loop_plan": [{"layer": 1, "heads": [0, 0], "depth": 1}]}, "unique"),
        ({"loop_plan": [{"layer": 1, "heads": [], "depth": 1}]}, "non-empty"),
        ({"loop_plan": [{"layer": 1, "heads": [0]}, {"layer": 1, "heads": [1]}]}, "twice"),
        ({"loop_plan": [{"layer": 1, "head": [0], "depth": 1}]}, "loop_plan entries"),
        ({"head_decay": "exp"}, "head_decay"),
        ({"entropy_estimator": "all"}, "entropy_estimator"),
        ({"loop_mode": "layers"}, "loop_mode"),
        ({"entropy_ema": 1.0}, "entropy_ema"),
        ({"growth_window": 0}, "growth_window"),
        ({"growth_start": 0}, "growth_start"),
        ({"max_loop_depth": 0}, "max_loop_depth"),
        ({"heads_per_layer": 5}, "heads_per_layer"),
        ({"growth_exclude_layers": [3]}, "growth_exclude_layers"),
        ({"head_keep_schedule": [2, 3]}, "head_keep_schedule"),
        ({"head_keep_schedule": [3, 1]}, "head_keep_schedule"),
        ({"block_loop_layers": [5], "loop_mode": "block"}, "block_loop_layers"),
        ({"loop_mode": "block", "loop_plan": PLAN}, "loop_plan"),
    ],
)
def test_invalid_config_raises_naming_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        SGTConfig(**{**BASE, **over})


def test_config_plan_forms_and_roundtrip(tmp_path):
    cfg = SGTConfig(**BASE, loop_plan={"2": {"heads": [1], "depth": 1}, "1": {"heads": [3, 0], "depth": 2}})
    assert cfg.loop_plan == PLAN  # mapping form → canonical list, sorted layers and heads
    assert cfg.growth_exclude_layers == [0] and cfg.head_keep_schedule == [2]
    assert (cfg.growth_start, cfg.growth_window, cfg.growth_top_layers, cfg.growth_max_layers) == (250, 250, 3, 3)
    assert (cfg.max_loop_depth, cfg.entropy_ema, cfg.head_decay, cfg.entropy_estimator) == (1, 0.5, "linear",
                                                                                            "last_row")
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["loop_plan"] == PLAN
    again = SGTConfig.from_pretrained(tmp_path)
    assert again.loop_plan == PLAN and again.model_type == "sgt"


# ---------------------------------------------------------------------------------------------------------------------
# exactness and the looping equation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [None, [{"layer": 1, "heads": [0, 2], "depth": 0}]])
def test_empty_plan_is_qwen3(plan):
    model = make(plan)
    qwen = Qwen3ForCausalLM(Qwen3Config(**BASE)).eval()
    assert set(qwen.state_dict()) == set(model.state_dict())  # Qwen3 names, no new parameters
    qwen.load_state_dict(model.state_dict())
    x = ids()
    mask = torch.ones_like(x)
    diff = (model(x, attention_mask=mask).logits - qwen(x, attention_mask=mask).logits).abs().max().item()
    assert diff <= 1e-6, diff
    # left padding with explicit positions (what generate passes): still Qwen3's logits
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    got = model(x, attention_mask=mask, position_ids=pos).logits
    want = qwen(x, attention_mask=mask, position_ids=pos).logits
    assert (got - want)[mask.bool()].abs().max().item() <= 1e-6


def test_convert_qwen3_checkpoint_key_preserving(tmp_path):
    from hf_loops.conversion.convert import convert_qwen3

    torch.manual_seed(3)
    qwen = Qwen3ForCausalLM(Qwen3Config(**BASE)).eval()
    qwen.save_pretrained(tmp_path)
    x = ids()
    plain = convert_qwen3(str(tmp_path), "sgt").eval()
    looped = convert_qwen3(qwen, "sgt", loop_plan=PLAN).eval()
    assert type(plain) is SGTForCausalLM and looped.config.loop_plan == PLAN
    with torch.no_grad():
        assert (plain(x).logits - qwen(x).logits).abs().max().item() <= 1e-6
        assert (looped(x).logits - _reference_logits(looped, x, PLAN)).abs().max().item() < 1e-5


def _reference_logits(model, x, plan, gates=None):
    """The spec's looping equation written out with eager attention over all heads (§1), independent of the model's
    loop code: H0 = X + Attn(Norm_a X); Hk = H(k-1) + W_O·concat(g_h·A_h V_h)(Norm_a H(k-1)); Y = HK + FFN(Norm_f HK)."""
    cfg = model.config
    base = model.model
    plan = {e["layer"]: e for e in plan}
    t = x.shape[1]
    h = base.embed_tokens(x)
    pos = torch.arange(t)[None]
    cos, sin = base.rotary_emb(h, pos)
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def attention(layer, z, gate):
        a = layer.self_attn
        b = z.shape[0]
        q = a.q_norm(a.q_proj(z).view(b, t, -1, a.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(z).view(b, t, -1, a.head_dim)).transpose(1, 2)
        v = a.v_proj(z).view(b, t, -1, a.head_dim).transpose(1, 2)
        rot = lambda u: torch.cat([-u[..., a.head_dim // 2:], u[..., : a.head_dim // 2]], -1)  # noqa: E731
        q, k = q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) * a.head_dim ** -0.5
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        o = (p @ v) * gate[None, :, None, None]
        return a.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    for i, layer in enumerate(base.layers):
        ones = torch.ones(cfg.num_attention_heads)
        h = h + attention(layer, layer.input_layernorm(h), ones)
        if i in plan:
            e = plan[i]
            g = torch.tensor(gates[i]) if gates and i in gates else torch.zeros(cfg.num_attention_heads).index_fill(
                0, torch.tensor(e["heads"]), 1.0)
            for _ in range(e["depth"]):
                h = h + attention(layer, layer.input_layernorm(h), g)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(base.norm(h))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_looping_equation_matches_reference(attn):
    model = with_plan(make(), PLAN)
    model.set_attn_implementation(attn)
    x = ids()
    with torch.no_grad():
        got, ref = model(x).logits, _reference_logits(model, x, PLAN)
        plain = make()(x).logits
    assert (got - ref).abs().max().item() < 1e-5
    assert (got - plain).abs().max().item() > 1e-3  # the loops do change the output


def test_decaying_gates_match_reference():
    model = with_plan(make(), PLAN)
    gates = {1: [1.0, 0.25, 0.5, 1.0], 2: [0.0, 1.0, 0.75, 0.0]}
    for layer, g in gates.items():
        e = next(p for p in PLAN if p["layer"] == layer)
        model.model.set_loop(layer, [h for h in range(4) if g[h] > 0], e["depth"], g)
    x = ids()
    with torch.no_grad():
        sliced = model(x).logits
        for layer in model.model.layers:
            layer.loop_masked = True
        masked = model(x).logits
    ref = _reference_logits(model, x, PLAN, gates)
    assert (sliced - ref).abs().max().item() < 1e-5
    assert (masked - ref).abs().max().item() < 1e-5
    # mid-window decoding: the slots hold every kv head with g > 0 and stay exact
    for layer in model.model.layers:
        layer.loop_masked = False
    with torch.no_grad():
        out = model(x[:, :6], use_cache=True)
        steps = [out.logits]
        for i in range(6, x.shape[1]):
            out = model(x[:, i:i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - sliced).abs().max().item() < 1e-5
    assert out.cache.layers[3].keys.shape[1] == 2  # layer 1 loops heads {0, 1, 2, 3} (g > 0) → both kv heads
    assert out.cache.layers[5].keys.shape[1] == 2  # layer 2 loops heads {1, 2} → kv heads κ = h // 2 = {0, 1}


@pytest.mark.parametrize("shape", [MHA, BASE], ids=["mha", "gqa"])
def test_sliced_equals_masked_after_window(shape):
    model = with_plan(make(**shape), PLAN, **shape)
    x = ids(3, 12)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # padding respected by both paths
    with torch.no_grad():
        sliced = model(x, attention_mask=mask).logits
        for layer in model.model.layers:
            layer.loop_masked = True  # all heads, gates 1 on kept / 0 elsewhere, before W_O
        masked = model(x, attention_mask=mask).logits
    diff = (sliced - masked).abs().max().item()
    assert diff <= 1e-5, diff


def test_gradient_checkpointing_keeps_loss_and_entropy():
    model = with_plan(make(), PLAN).train()
    model.model.set_entropy_statistics(True)
    x = ids()
    loss = model(x, labels=x).loss
    loss.backward()
    sums, counts = model.model.pop_entropy_statistics(2)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_gc = model(x, labels=x).loss
    loss_gc.backward()
    sums_gc, counts_gc = model.model.pop_entropy_statistics(2)
    assert torch.allclose(loss, loss_gc)
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, model.parameters(), strict=False))
    # recomputation may probe twice; the per-micro-batch mean is unchanged
    assert torch.allclose(sums / counts.clamp_min(1), sums_gc / counts_gc.clamp_min(1), atol=1e-6)


def test_sliced_loop_trains_shared_weights():
    model = with_plan(make(), [{"layer": 2, "heads": [1], "depth": 1}]).train()
    x = ids()
    model(x, labels=x).loss.backward()
    grad_o = model.model.layers[2].self_attn.o_proj.weight.grad
    assert grad_o is not None and grad_o.abs().sum() > 0
    # No new parameters: the loop's gradient lands on the layer's own projections.
    assert {n for n, _ in model.named_parameters()} == set(Qwen3ForCausalLM(Qwen3Config(**BASE)).state_dict())


# ---------------------------------------------------------------------------------------------------------------------
# KV cache, padding, generation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [MHA, BASE], ids=["mha", "gqa"])
def test_cache_token_by_token_equals_full_forward(shape):
    model = with_plan(make(**shape), PLAN, **shape)
    x = ids(2, 9)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = DynamicCache(config=model.config)  # what generate builds: num_hidden_layers layers only
        out = model(x[:, :3], cache=cache, use_cache=True)  # prefill
        steps = [out.logits]
        out = model(x[:, 3:6], cache=out.cache, use_cache=True)  # a chunk on top of a cache
        steps.append(out.logits)
        for i in range(6, 9):  # token by token
            out = model(x[:, i:i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    diff = (torch.cat(steps, 1) - full).abs().max().item()
    assert diff < 1e-5, diff
    cache = out.cache
    assert cache.get_seq_length() == 9
    # 3 base layers + slots (1,1), (1,2), (2,1); each slot holds only the kept heads' kv groups.
    groups = shape["num_attention_heads"] // shape["num_key_value_heads"]
    kv = [len({h // groups for h in [0, 3]})] * 2 + [1]
    assert len(cache.layers) == 3 + 3
    assert [layer.keys.shape[1] for layer in cache.layers[3:]] == kv


def test_left_padded_batch_equals_single_rows():
    model = with_plan(make(), PLAN)
    a, b = ids(1, 7, seed=2)[0], ids(1, 4, seed=3)[0]
    x = torch.stack([a, torch.cat([torch.zeros(3, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    with torch.no_grad():
        batch = model(x, attention_mask=mask).logits
        single = model(b[None]).logits
        gen_batch = model.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False)
        gen_single = model.generate(b[None], max_new_tokens=5, do_sample=False)
    assert (batch[1, 3:] - single[0]).abs().max().item() < 1e-5
    assert torch.equal(gen_batch[1, 3:], gen_single[0])


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_cache_equals_without(num_beams):
    model = with_plan(make(), PLAN)
    x = ids(2, 6)
    kw = dict(max_new_tokens=7, do_sample=False, num_beams=num_beams)
    with torch.no_grad():
        cached = model.generate(x, use_cache=True, **kw)
        uncached = model.generate(x, use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    assert cached.shape[1] == 13


# ---------------------------------------------------------------------------------------------------------------------
# entropy probe
# ---------------------------------------------------------------------------------------------------------------------


def _layer_qk(model, x, layer_idx):
    """Post-RoPE q and (GQA-expanded) k of layer `layer_idx`'s first pass, recomputed from its input."""
    captured = {}
    layer = model.model.layers[layer_idx]
    hook = layer.input_layernorm.register_forward_hook(lambda m, i, o: captured.setdefault("z", o))
    with torch.no_grad():
        model(x)
    hook.remove()
    a, z = layer.self_attn, captured["z"]
    b, t = x.shape
    q = a.q_norm(a.q_proj(z).view(b, t, -1, a.head_dim)).transpose(1, 2)
    k = a.k_norm(a.k_proj(z).view(b, t, -1, a.head_dim)).transpose(1, 2)
    cos, sin = model.model.rotary_emb(z, torch.arange(t)[None])
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k.repeat_interleave(a.num_key_value_groups, 1)


def test_entropy_probe_equals_full_attention_last_row():
    model = make()
    model.set_attn_implementation("eager")
    x = ids(2, 11)
    q, k = _layer_qk(model, x, 1)
    # Full T×T eager attention matrix, row T−1, entropy / log T (reference estimator, clamp 1e-12 as the official code).
    probs = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).masked_fill(
        ~torch.ones(11, 11, dtype=torch.bool).tril(), float("-inf")).softmax(-1)[:, :, -1]
    ref = (-(probs * probs.clamp_min(1e-12).log()).sum(-1) / torch.log(torch.tensor(11.0))).mean(0)
    model.train()
    model.model.set_entropy_statistics(True)
    model(x)
    sums, counts = model.model.pop_entropy_statistics(0)
    assert torch.all(counts[:, 0] == 1)
    assert (sums[1, 0] - ref).abs().max().item() < 1e-5
    # Direct call: right padding → the last *valid* row, normalised by log(#visible keys).
    rows = torch.tensor([[10], [6]])
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool).tril()
    mask[1, :, :, 7:] = False
    got = attention_row_entropy(q, k, mask, rows, q.shape[-1] ** -0.5)
    s1 = (q[1, :, 6:7] @ k[1, :, :7].transpose(-1, -2)).squeeze(1) * q.shape[-1] ** -0.5
    a1 = s1.softmax(-1)
    row1 = -(a1 * a1.log()).sum(-1) / torch.log(torch.tensor(7.0))
    row0 = -(probs[0] * probs[0].clamp_min(1e-12).log()).sum(-1) / torch.log(torch.tensor(11.0))
    assert (got - (row0 + row1) / 2).abs().max().item() < 1e-5


def test_entropy_probe_covers_loops_and_sampled_rows():
    model = with_plan(make(), PLAN, entropy_estimator="sampled_rows", entropy_sample_rows=3).train()
    model.model.set_entropy_statistics(True)
    x = ids(2, 12)
    model(x)
    model(x)  # two micro-batches
    sums, counts = model.model.pop_entropy_statistics(2)
    assert torch.all(counts[:, 0] == 2)  # first pass of every layer
    assert counts[1, 1].tolist() == [2, 0, 0, 2] and counts[1, 2].tolist() == [2, 0, 0, 2]  # kept heads' loops
    assert counts[2, 1].tolist() == [0, 2, 0, 0] and counts[2, 2].sum() == 0
    mean = sums / counts.clamp_min(1)
    assert torch.all((mean >= 0) & (mean <= 1))
    model.model.set_entropy_statistics(False)
    model(x)
    assert model.model.pop_entropy_statistics(2)[1].sum() == 0


# ---------------------------------------------------------------------------------------------------------------------
# save / load / remote code
# ---------------------------------------------------------------------------------------------------------------------


def test_save_and_auto_load_builds_the_plan(tmp_path):
    model = with_plan(make(), PLAN)
    x = ids()
    with torch.no_grad():
        before = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is SGTForCausalLM
    assert loaded.model.loop_structure() == PLAN
    with torch.no_grad():
        assert (loaded(x).logits - before).abs().max().item() == 0.0


@pytest.mark.slow
def test_export_loads_with_remote_code_without_hf_loops(tmp_path):
    model = with_plan(make(), PLAN)
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
    out = export(model, tmp_path / "sgt-export")
    assert {"modeling_sgt.py", "configuration_sgt.py", "loop_utils.py"} <= set(os.listdir(out))
    torch.save({"x": x, "expected": expected}, tmp_path / "io.pt")
    child = textwrap.dedent(f"""
        import sys
        sys.modules["hf_loops"] = None
        import torch
        from transformers import AutoModelForCausalLM
        io = torch.load({str(tmp_path / "io.pt")!r})
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert "hf_loops" not in type(m).__module__, type(m).__module__
        with torch.no_grad():
            d = (m(io["x"]).logits - io["expected"]).abs().max().item()
            g1 = m.generate(io["x"], max_new_tokens=4, do_sample=False)
            g2 = m.generate(io["x"], max_new_tokens=4, do_sample=False, use_cache=False)
        assert torch.equal(g1, g2)
        print("MAXDIFF", d, m.model.loop_structure())
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("MAXDIFF")][0]
    assert float(line.split()[1]) <= 1e-6, line


# ---------------------------------------------------------------------------------------------------------------------
# Block Loop baseline
# ---------------------------------------------------------------------------------------------------------------------


def test_block_loop_baseline():
    model = with_plan(make(), None, loop_mode="block", block_loop_layers=[1, 2], block_loop_depth=2)
    x = ids(2, 8)
    with torch.no_grad():
        got = model(x, use_cache=False).logits
        # reference: the selected blocks are applied 1 + depth times, x ← B_l(x)
        qwen = Qwen3ForCausalLM(Qwen3Config(**BASE)).eval()
        qwen.load_state_dict(model.state_dict())
        qb = qwen.model
        h = qb.embed_tokens(x)
        pos = torch.arange(8)[None]
        pe = qb.rotary_emb(h, pos)
        mask = torch.full((8, 8), float("-inf")).triu(1)[None, None]
        for i, layer in enumerate(qb.layers):
            for _ in range(3 if i in (1, 2) else 1):
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        ref = qwen.lm_head(qb.norm(h))
        assert (got - ref).abs().max().item() < 1e-5
        out = model(x[:, :5], use_cache=True)
        steps = [out.logits]
        for i in range(5, 8):
            out = model(x[:, i:i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - got).abs().max().item() < 1e-5
    assert len(out.cache.layers) == 3 + 2 * 2  # one full slot per extra block application
    assert torch.equal(model.generate(x, max_new_tokens=4, do_sample=False),
                       model.generate(x, max_new_tokens=4, do_sample=False, use_cache=False))


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------------


def test_flops_reproduce_released_config_ratios():
    d, dh, layers, t, n = 1024, 64, 16, 4096, 371e6
    kw = dict(d_model=d, head_dim=dh, seq_len=t, num_params=n, num_layers=layers)
    assert loop_flops_per_token(d, dh, 2, t) == 8 * 2 * dh * d + 4 * t * 2 * dh
    assert round(100 * sgt_overhead([(2, 1)], **kw), 2) == 0.31
    assert round(100 * sgt_overhead([(2, 1)] * 3, **kw), 2) == 0.93
    assert round(100 * sgt_overhead([(2, 3)] * 3, **kw), 1) == 2.8
    bkw = dict(d_model=d, seq_len=t, num_params=n, num_layers=layers)
    assert round(100 * block_loop_overhead(1, **bkw), 2) == 4.98
    assert round(100 * block_loop_overhead(3, **bkw), 1) == 14.9
    # From a config: the OLMo-300M shape as an SGT config (untied, vocab 50304) gives N ≈ 371M and the same ratios.
    olmo = SGTConfig(vocab_size=50304, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=dh, tie_word_embeddings=False,
                     loop_plan=[{"layer": 15, "heads": [3, 7], "depth": 1}])
    assert abs(parameters_of_config(olmo) / 1e6 - 371.5) < 0.5
    assert round(100 * plan_overhead(olmo, t), 2) == 0.31
    # Block Loop baseline as a configuration: 3 blocks → 14.9 % with the same N.
    fields = {k: v for k, v in olmo.to_dict().items() if k not in ("model_type", "transformers_version")}
    block = SGTConfig(**{**fields, "loop_plan": None, "loop_mode": "block", "block_loop_layers": [9, 12, 15]})
    assert round(100 * plan_overhead(block, t, num_params=n), 1) == 14.9
    # training overhead of a run = mean of the per-step overheads (vanilla steps count 0)
    assert training_overhead([0.0, 0.0, 0.02, 0.01]) == pytest.approx(0.0075)
    # GQA: only the kv heads serving the kept heads are counted.
    gqa = loop_flops_per_token(d, dh, 2, t, num_kv_heads=1)
    assert gqa == 2 * d * 2 * dh + 4 * d * 1 * dh + 2 * 2 * dh * d + 4 * t * 2 * dh
