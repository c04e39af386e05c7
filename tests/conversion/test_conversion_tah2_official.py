"""Import of the authors' TaH2 checkpoint layout (spec tah2.md §8, acceptance test 10) and export back."""

import json
import os

import pytest
import torch
from helpers.conversion_helpers import Qwen3MLPIterDecider, tiny_qwen3, write_official_tah2
from transformers import AutoModelForCausalLM

from hf_loops import TaH2ForCausalLM
from hf_loops.cli import main
from hf_loops.conversion import convert_qwen3, export_tah2, import_tah2

IDS = torch.randint(4, 97, (2, 9), generator=torch.Generator().manual_seed(3))


def direct_tah2(tied=False, seed=0, rope_theta=None, **kw):
    """The equivalent model built directly (convert + decisive decider, as the official files will hold it)."""
    rope = {} if rope_theta is None else {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}}
    q = tiny_qwen3(seed, tie_word_embeddings=tied, **rope)
    kw = {"max_iterations": 3, "exit_threshold": 0.375, "iteration_attention": "duo", **kw}
    model = convert_qwen3(q, "tah2", **kw).eval()
    if model.decider is not None:
        with torch.no_grad():
            torch.manual_seed(seed + 1)
            model.decider.score.weight.normal_(0.0, 3.0)
    return model


def _out(model):
    with torch.no_grad():
        o = model(IDS, use_cache=False)
    return o.logits, o.iter_counts


@pytest.mark.parametrize("tied", [False, True])
def test_official_layout_imports_with_the_same_logits(tmp_path, tied):
    ref = direct_tah2(tied=tied)
    path = write_official_tah2(tmp_path / "official", ref)
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tah_config.json", "iter_decider.bin", "input_updater.bin"} <= files
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3"

    for loaded in (TaH2ForCausalLM.from_pretrained(path), convert_qwen3(path, "tah2"), import_tah2(path)):
        assert isinstance(loaded, TaH2ForCausalLM)
        c = loaded.config
        assert (c.max_iterations, c.exit_threshold, c.iteration_attention, c.mixture) == (3, 0.375, "duo", "stop_prob")
        assert c.decider_topk == c.hidden_size and c.tie_word_embeddings == tied
        logits, depths = _out(loaded)
        ref_logits, ref_depths = _out(ref)
        assert torch.equal(depths, ref_depths) and depths.max() > 1  # the loop really runs
        assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("tied", [False, True])
def test_import_export_import_is_bit_identical(tmp_path, tied):
    ref = direct_tah2(tied=tied, iteration_attention="causal")
    first = import_tah2(write_official_tah2(tmp_path / "a", ref, mixture="even_mix"))
    assert first.config.mixture == "even"
    out = export_tah2(first, tmp_path / "b")
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen3"
    second = import_tah2(out)
    assert first.config.to_dict() == {**second.config.to_dict(), "_name_or_path": first.config._name_or_path}
    s1, s2 = first.state_dict(), second.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(_out(first)[0], _out(second)[0])
    # the exported components use the official names, classes and the threshold buffer
    dec = torch.load(os.path.join(out, "iter_decider.bin"), weights_only=True)
    assert dec["class"] == "Qwen3MLPIterDecider" and "threshold" in dec["state_dict"]
    assert {"norm_first.weight", "norm_l.weight", "input_proj.weight", "score.weight"} <= set(dec["state_dict"])


def test_trivial_components_and_cli(tmp_path, capsys):
    ref = direct_tah2(decider="always", updater="identity", max_iterations=2)
    path = write_official_tah2(tmp_path / "official", ref, decider_class="AlwaysIterDecider",
                               updater_class="IdentityUpdater")
    loaded = TaH2ForCausalLM.from_pretrained(path)
    assert (loaded.config.decider, loaded.config.updater) == ("always", "identity")
    assert loaded.decider is None and loaded.updater is None
    assert torch.equal(_out(loaded)[0], _out(ref)[0])

    rc = main(["convert", path, "--arch", "tah2", "--out", str(tmp_path / "hf")])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "1-loop parity (max_iterations=1): max-abs-diff 0.000e+00" in out
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert reloaded.config.decider == "always" and torch.equal(_out(reloaded)[0], _out(ref)[0])


def test_pickle_needs_explicit_allow_pickle(tmp_path):
    ref = direct_tah2()
    path = write_official_tah2(tmp_path / "official", ref, decider_class_obj=Qwen3MLPIterDecider)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        TaH2ForCausalLM.from_pretrained(path)
    loaded = TaH2ForCausalLM.from_pretrained(path, allow_pickle=True)
    assert torch.equal(_out(loaded)[0], _out(ref)[0])


def test_official_layout_errors(tmp_path, caplog):
    ref = direct_tah2()
    # unknown component class
    bad = write_official_tah2(tmp_path / "unknown", ref, decider_class="Qwen3TransformerIterDecider")
    with pytest.raises(ValueError, match="unknown component class 'Qwen3TransformerIterDecider'"):
        TaH2ForCausalLM.from_pretrained(bad)
    # missing component file
    missing = write_official_tah2(tmp_path / "missing", ref)
    os.remove(os.path.join(missing, "input_updater.bin"))
    with pytest.raises(ValueError, match="input_updater.bin is missing"):
        convert_qwen3(missing, "tah2")
    nowts = write_official_tah2(tmp_path / "noweights", ref)
    os.remove(os.path.join(nowts, "model.safetensors"))
    with pytest.raises(ValueError, match="could not load the Qwen3 weights"):
        TaH2ForCausalLM.from_pretrained(nowts)
    # mismatched shapes: a decider for another hidden size
    shapes = write_official_tah2(tmp_path / "shapes", ref)
    blob = torch.load(os.path.join(shapes, "iter_decider.bin"), weights_only=True)
    blob["state_dict"]["input_proj.weight"] = torch.zeros(16, 80)
    torch.save(blob, os.path.join(shapes, "iter_decider.bin"))
    with pytest.raises(ValueError, match="input_proj.weight has shape"):
        TaH2ForCausalLM.from_pretrained(shapes)
    blob["state_dict"]["input_proj.weight"] = torch.zeros(32, 96)
    blob["state_dict"]["norm_l.weight"] = torch.ones(7)
    torch.save(blob, os.path.join(shapes, "iter_decider.bin"))
    with pytest.raises(ValueError, match="mismatched shapes"):
        TaH2ForCausalLM.from_pretrained(shapes)
    # the backbone is not Qwen3
    other = write_official_tah2(tmp_path / "llama", ref)
    cfg = json.load(open(os.path.join(other, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ValueError, match="found model_type 'llama'"):
        TaH2ForCausalLM.from_pretrained(other)
    # unrecognised init_args are reported, not fatal
    warn = write_official_tah2(tmp_path / "warn", ref, extra_init_args={"mystery_knob": 3})
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            TaH2ForCausalLM.from_pretrained(warn)
    finally:
        hf_logging.disable_propagation()
    assert "mystery_knob" in caplog.text
    # export refuses what the official layout cannot express
    with pytest.raises(ValueError, match="no official equivalent"):
        export_tah2(direct_tah2(mixture="final"), tmp_path / "final")
    assert not (tmp_path / "final").exists()


def test_hub_id_of_an_official_checkpoint(tmp_path):
    from unittest import mock

    ref = direct_tah2()
    path = write_official_tah2(tmp_path / "snapshot", ref)
    with mock.patch("huggingface_hub.snapshot_download", return_value=path) as dl:
        model = import_tah2("nics-efc/TaH2-tiny")
        again = convert_qwen3("nics-efc/TaH2-tiny", "tah2", exit_threshold=0.6)
    assert dl.call_count == 2 and "*.bin" in dl.call_args.kwargs["allow_patterns"]
    assert torch.equal(_out(model)[0], _out(ref)[0])
    assert again.config.exit_threshold == 0.6  # arguments override the checkpoint's values


# ----------------------------------------------------------------------------------------------------------------------
# What the authors' loader (TaHForCausalLM.from_pretrained under transformers 4.57) reads, restated from their code:
# it builds every component from tah_config.json's kwargs (never from the .bin's init_args for the decider), skips
# state-dict keys named in those kwargs, and lets a missing TaHConfig field default.
# ----------------------------------------------------------------------------------------------------------------------

QWEN3_457_FIELDS = {  # the keyword arguments of transformers 4.57's Qwen3Config (rotary: rope_theta / rope_scaling)
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "rope_theta", "rope_scaling", "attention_bias", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "attention_dropout",
}
TAH_CONFIG_FIELDS = [  # their TaHConfig dataclass, in order
    "embedding_key", "max_iter", "iter_decider", "input_updater", "train_loss", "eval_loss", "eval_iter_decider",
    "iter_label_generator", "iter_attention_mode", "attn_implementation", "iter_attention_impl",
    "weighted_hidden_method", "memory_lean_fp32_reductions", "iter_decider_kwargs", "input_updater_kwargs",
    "train_loss_kwargs", "eval_loss_kwargs", "eval_iter_decider_kwargs", "iter_label_generator_kwargs",
]
REGISTERED_LOSSES = {"NextTokenPredLoss", "IterDeciderLoss", "CombinedLoss"}
CONSTRUCTOR_ARGS = {  # each class's keyword arguments (max_iter is injected by their model)
    "Qwen3MLPIterDecider": {"hidden_size", "intermediate_size", "topk", "hidden_act", "rms_norm_eps", "threshold",
                            "max_iter", "dtype", "uniform_init", "stochastic_sampling", "base_warmup_steps",
                            "memory_lean_fp32_reductions"},
    "AlwaysIterDecider": {"max_iter", "threshold", "memory_lean_fp32_reductions"},
    "TrivialIterDecider": {"max_iter", "memory_lean_fp32_reductions"},
    "Qwen3MLPUpdater": {"hidden_size", "intermediate_size", "hidden_act", "rms_norm_eps", "enable_norm_pre_mlp",
                        "enable_norm_out"},
    "IdentityUpdater": set(),
}


def authors_decider_shapes(kw):
    """Parameter shapes their Qwen3MLPIterDecider builds from its kwargs (their defaults where a key is missing)."""
    d, ff = kw.get("hidden_size", 2048), kw.get("intermediate_size", 2048)
    shapes = {f"{n}.weight": (d,) for n in ("norm_first", "norm_last", "norm_l", "norm_out")}
    shapes.update({"input_proj.weight": (d, 3 * d), "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
                   "mlp.down_proj.weight": (d, ff), "score.weight": (1, d)})
    return shapes


def authors_updater_shapes(kw):
    d, ff = kw["hidden_size"], kw["intermediate_size"]
    shapes = {"projection.weight": (d, 2 * d), "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
              "mlp.down_proj.weight": (d, ff), "norm_prev.weight": (d,), "norm_last.weight": (d,)}
    if kw.get("enable_norm_pre_mlp", True):
        shapes["norm_pre_mlp.weight"] = (d,)
    if kw.get("enable_norm_out", True):
        shapes["norm_out.weight"] = (d,)
    return shapes


def check_against_the_authors_loader(path, model):
    """Field by field: every requirement of the authors' loader on the files `export_tah2` wrote."""
    cfg = model.config
    qwen = json.load(open(os.path.join(path, "config.json")))
    assert qwen["model_type"] == "qwen3" and QWEN3_457_FIELDS <= set(qwen), QWEN3_457_FIELDS - set(qwen)
    assert qwen["rope_theta"] == cfg.rope_parameters["rope_theta"]  # 4.57 ignores rope_parameters
    assert qwen["rope_scaling"] is None and qwen["dtype"] == "float32"
    tah = json.load(open(os.path.join(path, "tah_config.json")))
    assert list(tah) == TAH_CONFIG_FIELDS  # every field stated: nothing left to a default
    assert tah["embedding_key"] == "model.embed_tokens" and tah["max_iter"] == cfg.max_iterations
    assert tah["iter_attention_mode"] == cfg.iteration_attention and tah["eval_iter_decider"] is None
    assert {tah["train_loss"], tah["eval_loss"]} <= REGISTERED_LOSSES  # get_loss_func_class(None) fails
    dec_cls, upd_cls = tah["iter_decider"], tah["input_updater"]
    dkw, ukw = tah["iter_decider_kwargs"], tah["input_updater_kwargs"]
    assert set(dkw) == CONSTRUCTOR_ARGS[dec_cls] and set(ukw) == CONSTRUCTOR_ARGS[upd_cls]
    dec = torch.load(os.path.join(path, "iter_decider.bin"), weights_only=True)
    upd = torch.load(os.path.join(path, "input_updater.bin"), weights_only=True)
    assert (dec["class"], upd["class"]) == (dec_cls, upd_cls)
    if "threshold" in CONSTRUCTOR_ARGS[dec_cls]:
        assert dkw["threshold"] == cfg.exit_threshold  # their loader takes τ from here (it skips the buffer)
    assert dkw["max_iter"] == cfg.max_iterations
    if dec_cls == "Qwen3MLPIterDecider":
        assert dkw["dtype"] == {"__dtype__": True, "__str__": "torch.float32"}  # not their bf16 default
        assert (dkw["hidden_act"], dkw["rms_norm_eps"], dkw["stochastic_sampling"]) == ("silu", 1e-6, False)
        assert dkw["topk"] == dkw["hidden_size"] == cfg.hidden_size
        loaded = {k: v for k, v in dec["state_dict"].items() if k not in dkw}  # their filter, then strict=False
        assert {k: tuple(v.shape) for k, v in loaded.items()} == authors_decider_shapes(dkw)
        assert dec["init_args"]["dtype"] is torch.float32
    if upd_cls == "Qwen3MLPUpdater":
        assert {k: tuple(v.shape) for k, v in upd["state_dict"].items()} == authors_updater_shapes(ukw)
        assert (ukw["enable_norm_pre_mlp"], ukw["enable_norm_out"]) == (cfg.updater_norm_pre_mlp, cfg.updater_norm_out)
    else:
        assert upd["state_dict"] == {}


VARIANTS = [
    ({"rope_theta": 1e6}, False),
    ({"updater_norm_out": False, "decider_intermediate_size": 48, "updater_intermediate_size": 40}, True),
    ({"decider": "always", "updater": "identity", "max_iterations": 2}, False),
    ({"decider": "never", "max_iterations": 2}, False),
]


@pytest.mark.parametrize("kw, tied", VARIANTS)
def test_export_states_every_field_the_authors_loader_reads(tmp_path, kw, tied):
    model = direct_tah2(tied=tied, **kw)
    out = export_tah2(model, tmp_path / "official")
    check_against_the_authors_loader(out, model)
    back = import_tah2(out)
    assert torch.equal(_out(back)[0], _out(model)[0]) and torch.equal(_out(back)[1], _out(model)[1])


@pytest.mark.parametrize("kw, tied", VARIANTS)
@pytest.mark.slow
def test_export_import_export_is_byte_stable(tmp_path, kw, tied):
    first = export_tah2(direct_tah2(tied=tied, **kw), tmp_path / "a")
    second = export_tah2(import_tah2(first), tmp_path / "b")
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(second))
    for name in names:
        a, b = open(os.path.join(first, name), "rb").read(), open(os.path.join(second, name), "rb").read()
        assert a == b, name


def _hf_warnings(caplog, fn):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        caplog.clear()
        with caplog.at_level("WARNING"):
            result = fn()
    finally:
        hf_logging.disable_propagation()
    return result, caplog.text


def _edit_json(path, name, edit):
    file = os.path.join(path, name)
    data = json.load(open(file))
    edit(data)
    json.dump(data, open(file, "w"))


def _edit_bin(path, name, edit):
    file = os.path.join(path, name)
    blob = torch.load(file, weights_only=True)
    edit(blob)
    torch.save(blob, file)


def test_tah_config_threshold_wins_over_a_disagreeing_buffer(tmp_path, caplog):
    """The authors' loader builds the decider with tah_config.json's threshold and skips the buffer: so do we, and say
    so; without a threshold there, the buffer is τ."""
    ref = direct_tah2(exit_threshold=0.375)
    path = export_tah2(ref, tmp_path / "official")
    _edit_json(path, "tah_config.json", lambda t: t["iter_decider_kwargs"].update(threshold=0.6))
    model, text = _hf_warnings(caplog, lambda: import_tah2(path))
    assert model.config.exit_threshold == 0.6
    assert "disagrees" in text and "0.375" in text and "following tah_config.json" in text
    same = direct_tah2(exit_threshold=0.6)
    assert torch.equal(_out(model)[1], _out(same)[1]) and torch.equal(_out(model)[0], _out(same)[0])
    assert not torch.equal(_out(model)[1], _out(ref)[1])  # τ changes the depths here: the choice matters
    _edit_json(path, "tah_config.json", lambda t: t["iter_decider_kwargs"].pop("threshold"))
    model, text = _hf_warnings(caplog, lambda: import_tah2(path))
    assert model.config.exit_threshold == 0.375 and "disagrees" not in text


def test_import_honours_or_refuses_every_field(tmp_path, caplog):
    path = export_tah2(direct_tah2(rope_theta=1e6), tmp_path / "official")

    def variant(name, tah_edit=None, dec_edit=None, upd_edit=None, qwen_edit=None):
        out = tmp_path / name
        import shutil

        shutil.copytree(path, out)
        for edit, file, fn in ((tah_edit, "tah_config.json", _edit_json), (qwen_edit, "config.json", _edit_json),
                               (dec_edit, "iter_decider.bin", _edit_bin), (upd_edit, "input_updater.bin", _edit_bin)):
            if edit is not None:
                fn(out, file, edit)
        return str(out)

    # honoured
    m = import_tah2(variant("sample", lambda t: t["iter_decider_kwargs"].update(stochastic_sampling=True)))
    assert m.config.decision_mode == "sample"
    m, text = _hf_warnings(caplog, lambda: import_tah2(variant("cap", lambda t: t["iter_decider_kwargs"].update(
        max_iter=2))))
    assert m.config.max_iterations == 2 and "max_iter 2 < max_iter 3" in text
    m = import_tah2(variant("frozen", upd_edit=lambda b: b["init_args"].update(learnable_weight=False)))
    assert not any(p.requires_grad for p in m.updater.parameters())
    assert all(p.requires_grad for p in m.decider.parameters())
    m = import_tah2(variant("evalsame", lambda t: t.update(eval_iter_decider="iter_decider")))
    assert m.config.decider == "learned"
    as_type = {"__type__": True, "__module__": "tah2.model.iter_decider", "__name__": "Qwen3MLPIterDecider"}
    m = import_tah2(variant("typed", lambda t: t.update(iter_decider=as_type)))  # their serialised class form
    assert m.config.decider == "learned"
    # reported, not fatal
    _, text = _hf_warnings(caplog, lambda: import_tah2(variant("warm", lambda t: t["iter_decider_kwargs"].update(
        base_warmup_steps=100))))
    assert "base_warmup_steps=100" in text and "inference is unaffected" in text
    _, text = _hf_warnings(caplog, lambda: import_tah2(variant("bf16", lambda t: t["iter_decider_kwargs"].update(
        dtype={"__dtype__": True, "__str__": "torch.bfloat16"}))))
    assert "the authors run the decider in torch.bfloat16" in text
    _, text = _hf_warnings(caplog, lambda: import_tah2(variant("unknown", lambda t: t.update(mystery=1))))
    assert "unrecognised fields ['mystery']" in text
    # refused, naming the field
    refused = [
        (variant("gelu", lambda t: t["iter_decider_kwargs"].update(hidden_act="gelu")), "hidden_act must be 'silu'"),
        (variant("ugelu", lambda t: t["input_updater_kwargs"].update(hidden_act="gelu")), "input_updater: hidden_act"),
        (variant("eps", lambda t: t["iter_decider_kwargs"].update(rms_norm_eps=1e-5)), "rms_norm_eps must be 1e-06"),
        (variant("ueps", lambda t: t["input_updater_kwargs"].update(rms_norm_eps=1e-5)), "rms_norm_eps must be 1e-06"),
        (variant("eval", lambda t: t.update(eval_iter_decider="AlwaysIterDecider")), "eval_iter_decider"),
        (variant("size", lambda t: t["iter_decider_kwargs"].update(intermediate_size=7)), "intermediate_size 7"),
        (variant("emb", lambda t: t.update(embedding_key="embed")), "embedding_key must be"),
        (variant("cls", lambda t: t.update(iter_decider="AlwaysIterDecider")), "names iter_decider"),
        (variant("rope", qwen_edit=lambda q: q.update(rope_theta=1e4)), "rope_theta 10000.0 disagrees with rope_par"),
    ]
    for bad, message in refused:
        with pytest.raises(ValueError, match=message):
            import_tah2(bad)
    # the updater's .bin init_args count only when tah_config.json gives none (the authors' rule)
    bare = variant("bare", lambda t: t.update(input_updater_kwargs={}),
                   upd_edit=lambda b: b["init_args"].update(rms_norm_eps=1e-5))
    with pytest.raises(ValueError, match="input_updater: rms_norm_eps"):
        import_tah2(bare)


def test_export_refuses_a_decider_the_authors_cannot_build(tmp_path):
    with pytest.raises(ValueError, match="decider_topk must equal hidden_size"):
        export_tah2(direct_tah2(decider_topk=8), tmp_path / "topk")
    assert not (tmp_path / "topk").exists()


@pytest.mark.slow
def test_seeded_sweep_export_meets_the_authors_loader_and_round_trips(tmp_path):
    """Over the exportable configuration space (seeded): the files meet the authors' loader field by field, import
    gives back the same config, weights and outputs, and a second export is byte-identical."""
    import random

    rng = random.Random(20)
    for case in range(8):
        decider = rng.choice(["learned", "learned", "always", "never"])
        kw = {
            "tied": rng.random() < 0.5, "seed": case, "rope_theta": rng.choice([None, 1e6, 5e5]),
            "max_iterations": rng.randint(1, 4) if decider != "never" else 2, "decider": decider,
            "exit_threshold": rng.choice([0.375, 0.5, 0.3, 0.7]),
            "iteration_attention": rng.choice(["duo", "causal", "same_iter"]),
            "mixture": rng.choice(["stop_prob", "even"]), "updater": rng.choice(["learned", "identity"]),
        }
        # the size / norm / sampling fields of a component only exist when the component has weights
        if kw["updater"] == "learned":
            kw.update(updater_norm_pre_mlp=rng.random() < 0.7, updater_norm_out=rng.random() < 0.7,
                      updater_intermediate_size=rng.choice([24, 32]))
        if decider == "learned":
            kw["decider_intermediate_size"] = rng.choice([32, 48])
            if rng.random() < 0.3:
                kw["decision_mode"] = "sample"
        model = direct_tah2(**kw)
        first = export_tah2(model, tmp_path / f"a{case}")
        check_against_the_authors_loader(first, model)
        back = import_tah2(first)
        mine, theirs = model.config.to_dict(), back.config.to_dict()
        meta = ("_name_or_path", "dtype")  # where it was loaded from; the dtype a loaded config records
        assert {k: v for k, v in theirs.items() if k not in meta} == {
            k: v for k, v in mine.items() if k not in meta}, case
        assert back.dtype == model.dtype == torch.float32
        s1, s2 = model.state_dict(), back.state_dict()
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1), case
        if kw.get("decision_mode") != "sample":
            assert torch.equal(_out(back)[0], _out(model)[0]) and torch.equal(_out(back)[1], _out(model)[1]), case
        second = export_tah2(back, tmp_path / f"b{case}")
        for name in sorted(os.listdir(first)):
            assert open(os.path.join(first, name), "rb").read() == open(os.path.join(second, name), "rb").read(), (
                case, name)
