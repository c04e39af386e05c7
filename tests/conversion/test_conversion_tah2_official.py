"""Import of the authors' TaH2 checkpoint layout (spec tah2.md §8, acceptance test 10) and export back."""

import json
import os

import pytest
import torch
from conversion_helpers import Qwen3MLPIterDecider, tiny_qwen3, write_official_tah2
from transformers import AutoModelForCausalLM

from hf_loops import TaH2ForCausalLM
from hf_loops.cli import main
from hf_loops.conversion import convert_qwen3, export_tah2, import_tah2

IDS = torch.randint(4, 97, (2, 9), generator=torch.Generator().manual_seed(3))


def direct_tah2(tied=False, seed=0, **kw):
    """The equivalent model built directly (convert + decisive decider, as the official files will hold it)."""
    q = tiny_qwen3(seed, tie_word_embeddings=tied)
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
