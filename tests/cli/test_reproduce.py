"""`hf-loops reproduce spiralformer --quick`: the whole pipeline on a tiny model and 60k characters of the shipped
text, 3 steps per run, 2 seeds (the full run's numbers are in docs/spiralformer.md; it is timed, not tested here)."""

import json
import os

import pytest

from hf_loops.cli import main
from hf_loops.reproduce import spiralformer as S


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce")
    out = root / "out"
    assert main(["reproduce", "spiralformer", "--quick", "--seeds", "2", "--out", str(out), "--workers", "2"]) == 0
    return {"root": root, "out": out, "summary": json.loads((out / "summary.json").read_text())}


@pytest.mark.slow
def test_summary_holds_every_arch_and_seed_with_the_claims(quick):
    s = quick["summary"]
    assert sorted(s["archs"]) == sorted(S.ARCHS)
    for arch in S.ARCHS:
        seeds = s["archs"][arch]["seeds"]
        assert sorted(seeds) == ["0", "1"]
        for f in seeds.values():
            assert f["test_loss"] > 0 and f["validation_loss"] > 0 and f["tokens"] == 3 * 2 * 64
            assert ("probes" in f) == (arch != "standard")
    sp = s["archs"]["spiral-b"]["seeds"]["0"]
    assert sp["probes"]["resolutions"] == [0.125, 0.25, 0.5, 1.0] and len(sp["probes"]["local_attention_mass"]) == 4
    assert len(s["archs"]["looped"]["seeds"]["0"]["probes"]["key_marginal_entropy"]) == 2
    assert s["archs"]["looped"]["seeds"]["1"]["prefill_flops_ratio"] == 1.0
    assert 0.5 < sp["prefill_flops_ratio"] < 1.0 and s["archs"]["standard"]["seeds"]["0"]["prefill_flops_ratio"] < 1
    assert [c["claim"][:13] for c in s["claims"]] == ["SpiralFormer-", "coarse → fine", "coarse → fine"]
    assert all(isinstance(c["held"], bool) for c in s["claims"])


@pytest.mark.slow
def test_outputs_and_the_first_seed_checkpoints(quick):
    from transformers import AutoModelForCausalLM

    out = quick["out"]
    assert {"summary.json", "report.md", "runs.json", "loss_curves.png", "coarse_to_fine.png"} <= set(os.listdir(out))
    assert not (out / "spiral-b-seed1").exists() and not [p for p in os.listdir(quick["root"]) if ".tmp-" in p]
    for arch in S.ARCHS:
        model = AutoModelForCausalLM.from_pretrained(out / f"{arch}-seed0")
        assert model.config.model_type == ("qwen3" if arch == "standard" else "spiralformer")
    report = (out / "report.md").read_text()
    for row in S.table(quick["summary"]["archs"])[1]:
        assert "| " + " | ".join(row) + " |" in report
    assert "--quick: a smoke run, not a result" in report


@pytest.mark.slow
def test_one_run_is_deterministic_and_the_flops_are_the_formulas(tmp_path):
    job = S.SpiralJob("spiral-b", 3, S.QUICK_MODEL, S.QUICK, str(tmp_path / "a"))
    a, b = S.run_spiral_one(job), S.run_spiral_one(S.SpiralJob("spiral-b", 3, S.QUICK_MODEL, S.QUICK, str(tmp_path / "b")))
    assert a["fields"]["test_loss"] == b["fields"]["test_loss"] and a["curve"] == b["curve"]
    from hf_loops.core.flops_spiralformer import SpiralShape, layer_flops

    std = S.build_spiral_model("standard", 8192, S.MODEL, 512, 0)
    shape = SpiralShape.from_config(std.config)
    assert S.prefill_flops(std.config, 512) == 4 * layer_flops(512, shape) + 2 * 128 * 8192 * 512


def test_the_claims_by_hand():
    def f(loss, ratio, lam=(0.4, 0.5), hkm=(0.9, 0.8)):
        return {"test_loss": loss, "prefill_flops_ratio": ratio,
                "probes": {"local_attention_mass": list(lam), "key_marginal_entropy": list(hkm)}}

    archs = {"looped": {"seeds": {"0": f(3.0, 1.0), "1": f(3.1, 1.0)}},
             "spiral-b": {"seeds": {"0": f(2.9, 0.93), "1": f(3.1, 0.93)}}}
    held = S.spiral_claims(archs)
    assert [ok for _, ok, _ in held] == [True, True, True]
    assert "lower or equal in 2 of 2 seeds, mean difference -0.0500" in held[0][2]
    archs["spiral-b"]["seeds"]["1"] = f(3.2, 0.96, lam=(0.5, 0.4), hkm=(0.8, 0.9))
    assert [ok for _, ok, _ in S.spiral_claims(archs)] == [False, False, False]


@pytest.mark.parametrize("name, argv, text", [
    ("spiralformer", ["--seeds", "0"], "--seeds"), ("spiralformer", ["--steps", "0"], "--steps"),
    ("spiralformer", ["--workers", "0"], "--workers"), ("analysis", ["--seeds", "0"], "--seeds"),
    ("analysis", ["--steps", "0"], "--steps"), ("analysis", ["--lr", "0"], "--lr"),
])
def test_bad_flags_are_one_line_and_write_nothing(tmp_path, capsys, name, argv, text):
    assert main(["reproduce", name, "--quick", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0]
    assert not (tmp_path / "o").exists()


def test_the_docs_give_the_committed_full_run():
    """docs/reproduce.md's tables and claim lines are the committed summary of the full run, row by row."""
    from helpers.common import REPO

    from hf_loops.evaluation.report import markdown_table

    with open(os.path.join(REPO, "docs", "reproduce_spiralformer_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(REPO, "docs", "reproduce.md"), encoding="utf-8") as f:
        doc = f.read()
    for t in (S.table(summary["archs"]), S.probe_table(summary["archs"])):
        for line in markdown_table(*t).splitlines():
            assert line in doc
    assert [c["held"] for c in summary["claims"]] == [ok for _, ok, _ in S.spiral_claims(summary["archs"])]
    for c in summary["claims"]:
        assert f"**{'held' if c['held'] else 'did not hold'}:** {c['claim']} ({c['numbers']})" in doc


# --------------------------------------------------------------------------------------------------------- sgt
@pytest.fixture(scope="module")
def quick_sgt(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce_sgt")
    out = root / "out"
    assert main(["reproduce", "sgt", "--quick", "--seeds", "2", "--out", str(out), "--workers", "2"]) == 0
    return {"root": root, "out": out, "summary": json.loads((out / "summary.json").read_text())}


@pytest.mark.slow
def test_sgt_summary_flops_and_the_grown_plan(quick_sgt):
    from transformers import AutoModelForCausalLM

    from hf_loops.core.flops_sgt import plan_overhead
    from hf_loops.reproduce import sgt as G

    s, out = quick_sgt["summary"], quick_sgt["out"]
    assert sorted(s["archs"]) == sorted(G.ARCHS) and len(s["claims"]) == 1
    for seed in ("0", "1"):
        v, b, g = (s["archs"][a]["seeds"][seed] for a in G.ARCHS)
        assert v["training_flops_ratio"] == 1.0 and v["parameters"] == b["parameters"] == g["parameters"]
        block = G.build_sgt_model("block", 8192, G.QUICK_MODEL, 64, 0)
        assert b["training_flops_ratio"] == pytest.approx(1 + plan_overhead(block.config, 64))
        # growth ran and froze: a plan outside the excluded layer 0, kept heads per layer, a small overhead
        assert g["loop_plan"] and all(e["layer"] != 0 and len(e["heads"]) == 2 for e in g["loop_plan"])
        assert [e["event"] for e in g["growth_events"]][-1] == "fix"
        assert 1.0 < g["training_flops_ratio"] < b["training_flops_ratio"]
    reloaded = AutoModelForCausalLM.from_pretrained(out / "sgt-seed0")
    assert reloaded.config.loop_plan == s["archs"]["sgt"]["seeds"]["0"]["loop_plan"]
    assert {"loss_curves.png", "loop_plan.png", "report.md", "vanilla-seed0", "block-seed0"} <= set(os.listdir(out))
    report = (out / "report.md").read_text()
    for row in G.sgt_table(s["archs"])[1] + G.plan_rows(s["archs"])[1]:
        assert "| " + " | ".join(row) + " |" in report


def test_the_sgt_claim_by_hand():
    from hf_loops.reproduce import sgt as G

    def f(loss, ratio):
        return {"test_loss": loss, "training_flops_ratio": ratio}

    archs = {"vanilla": {"seeds": {"0": f(3.0, 1.0)}}, "block": {"seeds": {"0": f(2.5, 1.125)}},
             "sgt": {"seeds": {"0": f(2.75, 1.0234375)}}}
    (name, ok, text), = G.sgt_claims(archs)
    assert ok and "(50 % of Block Loop's)" in text and "SGT 2.3 %, Block Loop 12.5 %" in text
    archs["sgt"]["seeds"]["0"] = f(2.75, 1.0625)  # the gain, but 6 % extra FLOPs
    assert G.sgt_claims(archs)[0][1] is False
    archs["block"]["seeds"]["0"] = f(3.25, 1.125)  # Block Loop gains nothing: nothing to get half of
    assert G.sgt_claims(archs)[0][1] is False and "Block Loop gains nothing" in G.sgt_claims(archs)[0][2]
    with pytest.raises(ValueError, match="arch must be one of"):
        G.build_sgt_model("loop", 100, G.QUICK_MODEL, 64, 0)


def test_the_docs_give_the_committed_sgt_run():
    """docs/reproduce.md's SGT tables and claim line are the committed summary of the full run."""
    from helpers.common import REPO

    from hf_loops.evaluation.report import markdown_table
    from hf_loops.reproduce import sgt as G

    with open(os.path.join(REPO, "docs", "reproduce_sgt_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(REPO, "docs", "reproduce.md"), encoding="utf-8") as f:
        doc = f.read()
    for t in (G.sgt_table(summary["archs"]), G.plan_rows(summary["archs"])):
        for line in markdown_table(*t).splitlines():
            assert line in doc
    assert [c["held"] for c in summary["claims"]] == [ok for _, ok, _ in G.sgt_claims(summary["archs"])]
    for c in summary["claims"]:
        assert f"**{'held' if c['held'] else 'did not hold'}:** {c['claim']} ({c['numbers']})" in doc
