"""SpiralFormer: the acceptance tests of shared/specs/spiralformer.md §14 on tiny random fp32 models (CPU)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config, Qwen3ForCausalLM

import hf_loops
from hf_loops import SpiralFormerConfig, SpiralFormerForCausalLM
from hf_loops.core.compat import cache_of
from hf_loops.modeling import modeling_spiralformer as msf

VOCAB = 97
EXTRA_MODULES = ("scorers", "allocators", "routers")


def make_config(**overrides) -> SpiralFormerConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=3,
        num_pre_layers=1,
        num_loop_layers=1,
        num_post_layers=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return SpiralFormerConfig(**kw)


def make_model(seed: int = 0, **overrides) -> SpiralFormerForCausalLM:
    """A random model whose learned scalings are switched on (A, B, routers are zero/near-uniform at init)."""
    torch.manual_seed(seed)
    model = SpiralFormerForCausalLM(make_config(**overrides)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if "scorers" in name or "allocators" in name or "routers" in name:
                p.normal_(0.0, 0.5)
    return model


# ----------------------------------------------------------------------------------------------------------------------
# §14.1 index algebra: reshape path == closed-form gather == per-token definition
# ----------------------------------------------------------------------------------------------------------------------


def naive_update(model, h, t):
    """ũ(t) straight from the operator definitions of spec §2 with Python loops over tokens (frames of §4.2)."""
    cfg = model.config
    core = model.model
    g = cfg.chunk_sizes[t]
    omega = g // 2 if cfg.chunk_offset == "half" else 0
    s = g - 1 if cfg.shift == "overlap" else g
    b, L, d = h.shape
    Lt = (L + omega) // g
    out = torch.zeros_like(h)
    if Lt == 0:
        return out
    z = torch.zeros(b, Lt, d)
    for j in range(Lt):
        members = [i for i in range(L) if (i + omega) // g == j]
        hs = h[:, members]
        if str(t) in core.scorers:
            a = torch.softmax(core.scorers[str(t)](hs).squeeze(-1), dim=-1)
            z[:, j] = (a.unsqueeze(-1) * hs).sum(1)
        else:
            z[:, j] = hs.sum(1) / g
    j_idx = torch.arange(Lt)
    lat_pos = msf.latent_position_ids(cfg, g, j_idx)[None].expand(b, Lt)
    mask = msf.additive_mask((j_idx[None, :] <= j_idx[:, None])[None, None], h.dtype)
    zhat, v = core._core(t, z, lat_pos, mask, None, False)
    beta = core._allocation(t, zhat)

    def u(i):  # u on real tokens only (frame A); None if the chunk is not closed
        j, r = (i + omega) // g, (i + omega) % g
        return math.sqrt(g) * beta[:, j, r, None] * v[:, j] if j < Lt else torch.zeros(b, d)

    for i in range(L):
        src = i - s
        if cfg.shift_frame == "literal":
            if src >= 0:
                out[:, i] = u(src)
        else:  # padded frame: slot p = src + ω of the frame (virtual slots of chunk 0 included)
            p = src + omega
            if p >= 0 and p // g < Lt:
                out[:, i] = math.sqrt(g) * beta[:, p // g, p % g, None] * v[:, p // g]
    return out


@pytest.mark.parametrize("shift", ["overlap", "no_overlap"])
@pytest.mark.parametrize("frame", ["literal", "padded"])
@pytest.mark.parametrize("offset", ["half", "zero"])
def test_reshape_path_equals_closed_form_gather(shift, frame, offset):
    model = make_model(chunk_sizes=[8, 4, 3, 2, 1], shift=shift, shift_frame=frame, chunk_offset=offset)
    core = model.model
    with torch.no_grad():
        for L in (37, 40, 5):
            h = torch.randn(2, L, 32)
            pos = torch.arange(L)[None].expand(2, L)
            valid = torch.ones(2, L, dtype=torch.bool)
            for t in range(len(model.config.chunk_sizes)):
                fast = core.spiral_step(h, t, pos, valid, aligned=True)
                gather = core.spiral_step(h, t, pos, valid, aligned=False)
                ref = naive_update(model, h, t)
                assert (fast - gather).abs().max() < 1e-6, (L, t)
                assert (fast - ref).abs().max() < 1e-5, (L, t)
                if L >= 2 * model.config.chunk_sizes[t] + 2:
                    assert fast.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------------
# §14.2 causality
# ----------------------------------------------------------------------------------------------------------------------


def _leak_positions(model, L=24, probes=(3, 9, 13, 17)):
    """Positions q < p whose logits change when the input embedding at p is perturbed."""
    torch.manual_seed(1)
    x = torch.randn(1, L, 32)
    leaks, later_changed = [], False
    with torch.no_grad():
        base = model(inputs_embeds=x, use_cache=False).logits
        for p in probes:
            x2 = x.clone()
            x2[:, p] += torch.randn(32)
            out = model(inputs_embeds=x2, use_cache=False).logits
            diff = (out - base).abs().amax(-1)[0]
            leaks += [q for q in range(p) if diff[q] > 1e-6]
            later_changed |= bool(diff[p:].max() > 1e-4)
    return leaks, later_changed


@pytest.mark.parametrize("topology", ["mesh", "anchor"])
@pytest.mark.parametrize("shift", ["overlap", "no_overlap"])
def test_causality(topology, shift):
    model = make_model(topology=topology, shift=shift)
    leaks, later_changed = _leak_positions(model)
    assert leaks == []
    assert later_changed


def test_shift_g_minus_2_leaks(monkeypatch):
    model = make_model(chunk_sizes=[4], topology="anchor", shift_frame="padded")
    monkeypatch.setattr(msf, "shift_of", lambda config, g: g - 2)
    leaks, _ = _leak_positions(model)
    assert leaks, "a shift of g − 2 must read a chunk that contains a later token"


# ----------------------------------------------------------------------------------------------------------------------
# §14.3 incremental decoding == full forward
# ----------------------------------------------------------------------------------------------------------------------


def _incremental_logits(model, ids, n0):
    cache = DynamicCache()
    outs = []
    with torch.no_grad():
        if n0 > 0:
            outs.append(model(ids[:, :n0], cache=cache, use_cache=True).logits)
        for i in range(n0, ids.shape[1]):
            outs.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize(
    "overrides",
    [
        dict(topology="mesh", shift="overlap"),
        dict(topology="anchor", shift="overlap"),
        dict(topology="mesh", shift="no_overlap", shift_frame="padded"),
        dict(topology="anchor", shift="no_overlap", latent_positions="last_token", core_output="delta"),
        dict(topology="mesh", downscale="mean", upscale="uniform", chunk_offset="zero", latent_positions="chunk_start"),
        dict(topology="anchor", num_hidden_layers=4, num_pre_layers=0, num_loop_layers=2, num_post_layers=2),
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
@pytest.mark.slow
def test_prefill_then_decode_equals_full_forward(overrides):
    model = make_model(**overrides)
    ids = torch.randint(2, VOCAB, (2, 21))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    worst = 0.0
    for n0 in (0, 1, 3, 7, 8, 9, 12):
        inc, cache = _incremental_logits(model, ids, n0)
        worst = max(worst, (inc - full).abs().max().item())
        assert cache.get_seq_length() == ids.shape[1]  # tokens, not latents
    assert worst < 1e-5, worst


def test_cropped_cache_decodes_like_the_shorter_prefix():
    model = make_model()
    ids = torch.randint(2, VOCAB, (1, 12))
    cache, fresh = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(ids[:, :10], cache=cache, use_cache=True)
        cache.crop(-2)  # what assisted decoding does after rejecting draft tokens
        got = model(ids[:, 8:9], cache=cache, use_cache=True).logits
        model(ids[:, :8], cache=fresh, use_cache=True)
        want = model(ids[:, 8:9], cache=fresh, use_cache=True).logits
    assert torch.equal(got, want)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model(topology="mesh")
    model.train()
    ids = torch.randint(2, VOCAB, (2, 18))
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    loss2 = model(ids, labels=ids, use_cache=False).loss
    loss2.backward()
    assert torch.allclose(loss, loss2)
    assert any("scorers" in n for n in ref) and any("allocators" in n for n in ref) and any("routers" in n for n in ref)
    for n, p in model.named_parameters():
        if n in ref:
            assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_depth_scaled_init():
    cfg = make_config(chunk_sizes=[8, 4, 2, 1], num_hidden_layers=4, num_loop_layers=2, initializer_range=0.02,
                      hidden_size=64, intermediate_size=256)
    torch.manual_seed(0)
    model = SpiralFormerForCausalLM(cfg)
    n_compute = 1 + 4 * 2 + 1
    o_std = torch.cat([layer.self_attn.o_proj.weight.flatten() for layer in model.model.layers]).std().item()
    q_std = torch.cat([layer.self_attn.q_proj.weight.flatten() for layer in model.model.layers]).std().item()
    assert q_std == pytest.approx(0.02, rel=0.1)
    assert o_std == pytest.approx(0.02 / math.sqrt(2 * n_compute), rel=0.1)


def test_multi_token_extension_of_a_cache():
    model = make_model()
    ids = torch.randint(2, VOCAB, (1, 19))
    cache = DynamicCache()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        a = model(ids[:, :6], cache=cache, use_cache=True).logits
        b = model(ids[:, 6:13], cache=cache, use_cache=True).logits  # 7 tokens against a non-empty cache
        c = model(ids[:, 13:], cache=cache, use_cache=True).logits
    assert (torch.cat([a, b, c], 1) - full).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# §14.4 trigger counts, §14.5 zero-update prefixes and G = [1]
# ----------------------------------------------------------------------------------------------------------------------


def _triggers_per_token(model, L):
    fired = []
    orig = model.model._core

    def spy(t, *args, **kwargs):
        fired[-1].append(model.config.chunk_sizes[t])
        return orig(t, *args, **kwargs)

    model.model._core = spy
    cache = DynamicCache()
    ids = torch.randint(2, VOCAB, (1, L))
    with torch.no_grad():
        fired.append([])
        model(ids[:, :1], cache=cache, use_cache=True)  # prefill of token 0 (runs every level's core once if Lt>0)
        for i in range(1, L):
            fired.append([])
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
    model.model._core = orig
    return fired


def test_trigger_counts_half_offset():
    model = make_model(chunk_sizes=[8, 4, 2, 1])
    fired = _triggers_per_token(model, 40)
    for i, gs in enumerate(fired):
        coarse = [g for g in gs if g > 1]
        assert gs.count(1) == 1  # g = 1 fires on every token
        assert len(coarse) <= 1, (i, gs)
        expected = [g for g in (8, 4, 2) if (i + g // 2 + 1) % g == 0]
        assert coarse == expected, (i, gs)
        if i % 8 == 7:
            assert coarse == []
        if i % 8 == 3:
            assert coarse == [8]


def test_trigger_burst_with_zero_offset():
    model = make_model(chunk_sizes=[8, 4, 2, 1], chunk_offset="zero")
    fired = _triggers_per_token(model, 24)
    assert sorted(g for g in fired[7] if g > 1) == [2, 4, 8]  # i ≡ 7 (mod 8): T − 1 coarse passes at once


@pytest.mark.parametrize(
    "shift,frame,expected",
    [
        ("overlap", "literal", {8: 7, 4: 3, 2: 1, 1: 0}),  # zero for tokens 0..g−2
        ("overlap", "padded", {8: 3, 4: 1, 2: 0, 1: 0}),  # 0..g−2−ω
        ("no_overlap", "literal", {8: 8, 4: 4, 2: 2, 1: 1}),  # 0..g−1
        ("no_overlap", "padded", {8: 4, 4: 2, 2: 1, 1: 1}),  # 0..g−1−ω
    ],
)
def test_zero_update_prefixes(shift, frame, expected):
    model = make_model(chunk_sizes=[8, 4, 2, 1], shift=shift, shift_frame=frame)
    L = 24
    h = torch.randn(1, L, 32)
    pos = torch.arange(L)[None]
    valid = torch.ones(1, L, dtype=torch.bool)
    with torch.no_grad():
        for t, g in enumerate(model.config.chunk_sizes):
            e = model.model.spiral_step(h, t, pos, valid, aligned=True)
            nonzero = (e.abs().amax(-1)[0] > 0).tolist()
            first = nonzero.index(True)
            assert first == expected[g], (g, first)
            assert all(nonzero[first:])


@pytest.mark.parametrize("topology", ["anchor", "mesh"])
def test_unit_chunk_schedule_is_a_plain_loop_step(topology):
    model = make_model(chunk_sizes=[1], topology=topology)
    core = model.model
    ids = torch.randint(2, VOCAB, (2, 11))
    L = ids.shape[1]
    idx = torch.arange(L)
    mask = msf.additive_mask((idx[None, :] <= idx[:, None])[None, None], torch.float32)
    pos = idx[None].expand(2, L)
    assert len(core.scorers) == 0 and len(core.allocators) == 0  # A and B are not created for g = 1
    with torch.no_grad():
        x = core.embed_tokens(ids)
        h = core._run(core.pre_layers, x, mask, pos, None, False)
        if topology == "anchor":
            h = h + core._run(core.core_layers, h, mask, pos, None, False)  # h(1) = h(0) + f_loop(h(0))
        else:
            ww, wr = core._route(0, x)
            M = torch.zeros(2, L, model.config.mesh_slots, 32)
            M[:, :, 0] = x
            M = M + ww.unsqueeze(-1) * h.unsqueeze(-2)
            h = (wr.unsqueeze(-1) * M).sum(-2)
            ww, wr = core._route(1, h)
            M = M + ww.unsqueeze(-1) * core._run(core.core_layers, h, mask, pos, None, False).unsqueeze(-2)
            h = (wr.unsqueeze(-1) * M).sum(-2)
        h = core._run(core.post_layers, h, mask, pos, None, False)
        ref = model.lm_head(core.norm(h))
        out = model(ids, use_cache=False).logits
    assert (out - ref).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# §14.6 parameter counts, §14.7 Qwen3 exactness
# ----------------------------------------------------------------------------------------------------------------------


def test_mesh_router_and_extra_parameter_counts():
    cfg = make_config(chunk_sizes=[8, 4, 2, 1])
    model = SpiralFormerForCausalLM(cfg)
    d, T, B = 32, 4, cfg.mesh_slots
    assert B == T + 3
    routers = sum(p.numel() for p in model.model.routers.parameters())
    assert routers == (T + 1) * 2 * B * (d + 1)
    extra = sum(p.numel() for n, p in model.named_parameters() if any(k in n for k in EXTRA_MODULES))
    assert extra == sum(d + (d + 1) * g for g in (8, 4, 2)) + 2 * (T + 1) * (d + 1) * B
    # zero-initialised scalings: training starts as mean pooling and uniform broadcast
    for name, p in model.named_parameters():
        if "scorers" in name or "allocators" in name:
            assert torch.count_nonzero(p) == 0, name
    # the MeSH paper's count: 3·2·5·(2048 + 1) = 61,470 for D = 2048, B = 5, two loop steps
    assert (2 + 1) * 2 * 5 * (2048 + 1) == 61_470


@pytest.mark.parametrize("topology", ["anchor", "mesh"])
def test_qwen3_exactness_contract(topology):
    qcfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_hidden_layers=3, attn_implementation="eager")
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(qcfg).eval()
    d = qcfg.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "auto_map"):
        d.pop(k, None)
    cfg = SpiralFormerConfig(**d, num_pre_layers=1, num_loop_layers=1, num_post_layers=1, chunk_sizes=[1],
                             core_output="delta", topology=topology, router_init="identity", depth_scaled_init=False)
    model = SpiralFormerForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(qwen.state_dict(), strict=False)
    assert unexpected == [] and all("routers" in k for k in missing)
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        diff = (model(ids).logits - qwen(ids).logits).abs().max().item()
    assert diff < 1e-5, diff
    print("QWEN3_EXACT", topology, diff)


# ----------------------------------------------------------------------------------------------------------------------
# §14.3 / §14.8 generate, left padding, beam search
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_with_cache_equals_without_and_beam_search():
    model = make_model()
    ids = torch.randint(2, VOCAB, (2, 9))
    with torch.no_grad():
        g1 = model.generate(ids, max_new_tokens=14, do_sample=False)
        g0 = model.generate(ids, max_new_tokens=14, do_sample=False, use_cache=False)
        assert torch.equal(g1, g0)
        b1 = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False)
        b0 = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
        assert torch.equal(b1, b0)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    layout = model.model.layout
    assert len(cache_of(out).layers) == layout.total
    assert cache_of(out).get_seq_length() == 9 + 3 - 1  # the last sampled token is not fed back


@pytest.mark.parametrize("topology", ["mesh", "anchor"])
@pytest.mark.slow
def test_left_padded_batch_equals_rows_alone(topology):
    model = make_model(topology=topology)
    rows = [torch.randint(2, VOCAB, (1, n)) for n in (5, 13, 9)]
    width = 13
    batch = torch.cat([torch.cat([torch.zeros(1, width - r.shape[1], dtype=torch.long), r], 1) for r in rows])
    mask = (batch != 0).long()  # token ids are >= 2, so exactly the pads are 0
    new = 12
    with torch.no_grad():
        gb = model.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False)
        gb0 = model.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=False)
        assert torch.equal(gb, gb0)
        for k, r in enumerate(rows):
            alone = model.generate(r, max_new_tokens=new, do_sample=False)[0, r.shape[1] :].tolist()
            batched = gb[k, width:].tolist()
            # a row that hit EOS alone stops; in the batch it is continued with pad tokens
            assert batched[: len(alone)] == alone, k
            assert all(tok == model.config.pad_token_id for tok in batched[len(alone) :]), k
        # logits of a left-padded prefill equal each row's own logits at its real tokens
        full = model(batch, attention_mask=mask, use_cache=False).logits
        for k, r in enumerate(rows):
            own = model(r, use_cache=False).logits
            assert (full[k, width - r.shape[1] :] - own[0]).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------------------------------
# save / load, remote code, attention backends, config validation
# ----------------------------------------------------------------------------------------------------------------------


def test_save_pretrained_auto_round_trip(tmp_path):
    model = make_model()
    ids = torch.randint(2, VOCAB, (2, 17))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is SpiralFormerForCausalLM
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.slow
def test_export_loads_with_remote_code_without_hf_loops(tmp_path):
    from hf_loops.conversion.export import export

    model = make_model(chunk_sizes=[4, 2, 1])
    ids = torch.randint(2, VOCAB, (2, 15))
    with torch.no_grad():
        expected = model(ids).logits
    out_dir = export(model, tmp_path / "spiral-export")
    assert (out_dir and os.path.exists(os.path.join(out_dir, "modeling_spiralformer.py")))
    torch.save({"ids": ids, "expected": expected}, tmp_path / "io.pt")
    child = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_loops"] = None
        import torch
        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM
        io = torch.load({str(tmp_path / "io.pt")!r})
        m = AutoModelForCausalLM.from_pretrained({str(out_dir)!r}, trust_remote_code=True,
                                                 attn_implementation="eager").eval()
        assert "hf_loops" not in type(m).__module__, type(m).__module__
        with torch.no_grad():
            d = (m(io["ids"]).logits - io["expected"]).abs().max().item()
            g1 = m.generate(io["ids"], max_new_tokens=5, do_sample=False)
            g0 = m.generate(io["ids"], max_new_tokens=5, do_sample=False, use_cache=False)
        assert torch.equal(g1, g0)
        print("MAXDIFF", d)
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    diff = float(res.stdout.split("MAXDIFF")[1].split()[0])
    assert diff == 0.0


def test_eager_and_sdpa_agree():
    model = make_model()
    ids = torch.randint(2, VOCAB, (2, 19))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        sdpa = model(ids, attention_mask=mask).logits
        inc, _ = _incremental_logits(model, ids, 5)
        full = model(ids).logits
    assert (eager - sdpa).abs().max() < 1e-5
    assert (inc - full).abs().max() < 1e-5


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(chunk_sizes=[8, 0, 1]), "chunk_sizes"),
        (dict(chunk_sizes=[]), "chunk_sizes"),
        (dict(num_pre_layers=2), "num_hidden_layers"),
        (dict(num_loop_layers=0, num_pre_layers=2), "num_loop_layers"),
        (dict(num_post_layers=None), "num_post_layers"),
        (dict(downscale="max"), "downscale"),
        (dict(upscale="nearest"), "upscale"),
        (dict(topology="ring"), "topology"),
        (dict(shift="half"), "shift"),
        (dict(chunk_offset="quarter"), "chunk_offset"),
        (dict(shift_frame="cropped"), "shift_frame"),
        (dict(latent_positions="first_token"), "latent_positions"),
        (dict(core_output="residual"), "core_output"),
        (dict(router_init="ones"), "router_init"),
        (dict(mesh_slots=1), "mesh_slots"),
        (dict(scale_embeddings="yes"), "scale_embeddings"),
    ],
)
def test_invalid_configs_raise(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_config(**overrides)


def test_packed_batches_are_refused():
    model = make_model()
    ids = torch.randint(2, VOCAB, (1, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="packed"):
        model(ids, position_ids=pos)


def test_registered_names():
    assert "spiralformer" in hf_loops.__all__ or "SpiralFormerConfig" in hf_loops.__all__
    from hf_loops.conversion.registry import get_architecture

    assert get_architecture("spiralformer") == (SpiralFormerConfig, SpiralFormerForCausalLM)
    assert make_config().model_type == "spiralformer"


# ----------------------------------------------------------------------------------------------------------------------
# §14.9 FLOPs and KV memory
# ----------------------------------------------------------------------------------------------------------------------


def test_flops_resolution_factors_and_parameter_formulas():
    from hf_loops.core import flops_spiralformer as fs

    s_r, s_r2 = fs.resolution_factors([8, 4, 2, 1])
    assert s_r == pytest.approx(1.875) and s_r / 4 == pytest.approx(0.469, abs=1e-3)
    assert s_r2 == pytest.approx(1.328, abs=1e-3) and s_r2 / 4 == pytest.approx(0.332, abs=1e-3)
    assert fs.resolution_factors([8, 4, 2])[0] == pytest.approx(0.875)
    assert fs.extra_parameters(1024, [8, 4, 2, 1], 7) == 89_172  # spec §8 example
    assert fs.mesh_router_parameters(2048, 2, 5) == 61_470  # MeSH Table 5
    assert fs.mesh_buffer_bytes(7, 4096, 2048, 2) == 117_440_512  # ≈ 117 MB
    # the formulas agree with the instantiated model
    cfg = make_config(chunk_sizes=[8, 4, 2, 1])
    model = SpiralFormerForCausalLM(cfg)
    extra = sum(p.numel() for n, p in model.named_parameters() if any(k in n for k in EXTRA_MODULES))
    assert fs.extra_parameters(32, cfg.chunk_sizes, cfg.mesh_slots) == extra
    # the core's linear part scales with Σ r_t, attention with Σ r_t² (c = 1, idealised latent counts)
    shape = fs.SpiralShape.from_config(cfg)
    L = 4096
    core_lin = sum(cfg.num_loop_layers * fs.layer_flops(L / g, shape, 0.0) for g in cfg.chunk_sizes)
    assert core_lin / (4 * cfg.num_loop_layers * fs.layer_flops(L, shape, 0.0)) == pytest.approx(1.875 / 4)
    assert fs.forward_flops(shape, L) < fs.looped_forward_flops(shape, L)
    assert fs.decode_core_flops_per_token(shape, 100) > 0


@pytest.mark.parametrize("n0,extra", [(13, 0), (6, 9)])
def test_kv_memory_formula_matches_cache_bytes(n0, extra):
    from hf_loops.core import flops_spiralformer as fs

    model = make_model(chunk_sizes=[8, 4, 2, 1], num_hidden_layers=4, num_pre_layers=1, num_loop_layers=2)
    ids = torch.randint(2, VOCAB, (1, n0 + extra))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n0], cache=cache, use_cache=True)
        for i in range(n0, n0 + extra):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
    kv = model.model.cache_bytes(cache)["kv"]
    assert kv == fs.kv_cache_bytes(fs.SpiralShape.from_config(model.config), n0 + extra, bytes_per_element=4)
