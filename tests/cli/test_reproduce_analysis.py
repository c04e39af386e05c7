"""`hf-loops reproduce analysis`: the mechanistic analysis's fixed-point and stage probes on the looped models the other
reproductions train. The `--quick` pipeline end to end (tiny models, a few steps, 2 seeds), the probes on a model whose
fixed point is known by construction, the claim rules and the stage rules on hand-made numbers, and docs/reproduce.md
against the committed summary of the full run."""

import json
import os

import pytest
import torch

from hf_loops.cli import main
from hf_loops.reproduce import analysis as A


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce_analysis")
    out = root / "out"
    assert main(["reproduce", "analysis", "--quick", "--seeds", "2", "--out", str(out), "--workers", "2"]) == 0
    return {"root": root, "out": out, "summary": json.loads((out / "summary.json").read_text())}


@pytest.mark.slow
def test_summary_holds_every_model_and_seed_with_the_claims(quick):
    s = quick["summary"]
    assert sorted(s["archs"]) == sorted(A.ARCHS)
    for arch in A.ARCHS:
        seeds = s["archs"][arch]["seeds"]
        assert sorted(seeds) == ["0", "1"]
        for f in seeds.values():
            assert 0 <= f["fixed_point_share"] <= 1 and f["tokens_probed"] > 0
            assert sum(f["limiting_behaviour"].values()) == pytest.approx(1.0)
            steps = f["stages"]
            assert {r["recurrence"] for r in steps} == set(range(1, A.QUICK_PROBES["stage_recurrences"] + 1))
            assert len(steps) == f["loop_layers"] * A.QUICK_PROBES["stage_recurrences"]
            assert all(len(c) == A.QUICK_PROBES["fixed_point_recurrences"] for c in f["fixed_point_cosine"].values())
            assert all(c[-1] == pytest.approx(1.0) for c in f["fixed_point_cosine"].values())  # X* is the last
            assert ("exact_match" in f) == (arch == "tah2") and ("test_loss" in f) == (arch != "tah2")
    # one loop layer (Block Loop): the two claims that compare layers are not measurable, the others are
    assert s["archs"]["block"]["seeds"]["0"]["loop_layers"] == 1 and s["archs"]["tah2"]["seeds"]["0"]["loop_layers"] == 2
    held = {c["claim"].split(":")[0]: [] for c in s["claims"]}
    for c in s["claims"]:
        held[c["claim"].split(":")[0]].append(c["held"])
    assert [len(v) for v in held.values()] == [4, 4, 4]
    assert held[A.LABELS["block"]][1] is None and held[A.LABELS["block"]][3] is None
    assert all(isinstance(v, bool) for v in held[A.LABELS["looped-anchor"]] + held[A.LABELS["tah2"]])


@pytest.mark.slow
def test_outputs_and_the_first_seed_checkpoints(quick):
    from transformers import AutoModelForCausalLM

    out, s = quick["out"], quick["summary"]
    assert {"summary.json", "report.md", "runs.json", "fixed_points.png", "stages.png"} <= set(os.listdir(out))
    assert not {"data", "runs", "tah2-seed1", "block-seed1"} & set(os.listdir(out))
    assert not [p for p in os.listdir(quick["root"]) if ".tmp-" in p]
    types = {"looped-anchor": "spiralformer", "block": "sgt", "tah2": "tah2"}
    for arch in A.ARCHS:
        model = AutoModelForCausalLM.from_pretrained(out / f"{arch}-seed0")
        assert model.config.model_type == types[arch]
    assert AutoModelForCausalLM.from_pretrained(out / "looped-anchor-seed0").config.topology == "anchor"
    report = (out / "report.md").read_text()
    for row in A.analysis_table(s["archs"])[1]:
        assert "| " + " | ".join(row) + " |" in report
    assert "--quick: a smoke run, not a result" in report and "**not measurable:**" in report


def _zero_core_anchor():
    """An anchor LoopedFormer whose core layers write nothing (zero o_proj / down_proj): core(h) = h, so
    h(t) = (t + 1)·h(0) — every token's direction is fixed from the first recurrence and both core layers share it."""
    from hf_loops.modeling.configuration_spiralformer import SpiralFormerConfig
    from hf_loops.modeling.modeling_spiralformer import SpiralFormerForCausalLM

    torch.manual_seed(0)
    cfg = SpiralFormerConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, num_pre_layers=1, num_loop_layers=2,
                             num_post_layers=1, chunk_sizes=[1, 1], topology="anchor", max_position_embeddings=64)
    model = SpiralFormerForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.core_layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.slow
def test_the_probes_on_a_model_whose_fixed_point_is_known():
    model = _zero_core_anchor()
    seqs = [torch.randint(0, 64, (20,)).tolist() for _ in range(2)]
    f = A.probe(model, seqs, {"fixed_point_recurrences": 16, "stage_recurrences": 6})
    assert f["fixed_point_share"] == 1.0 and f["tokens_probed"] == 40
    assert f["degenerate_score"] == pytest.approx(1.0, abs=1e-5)  # both core layers output the same state
    assert f["fixed_point_separation"] == pytest.approx(0.0, abs=1e-5)
    # the core's input at recurrence t is t·h(0): the last step moves it by 1/(T − 1) of itself
    assert f["final_motion"] == pytest.approx(1 / 15, rel=1e-4)
    assert f["loop_layers"] == 2 and f["stable_from"] == 1  # RMS-normed inputs never change: attention is constant
    assert f["stage_repeat_share"] == 1.0  # the two layers' own weights make two distinct, repeating stages
    for c in f["fixed_point_cosine"].values():
        assert c == pytest.approx([1.0] * 16, abs=1e-5)


def _rows(values: dict) -> list[dict]:
    return [{"layer": ell, "recurrence": t, **dict(zip(A.STAGE_METRICS, v, strict=True))}
            for (ell, t), v in values.items()]


def test_stage_rules_by_hand():
    # two layers with their own stage each recurrence: every step from recurrence 2 is nearest to its own layer
    rep = _rows({(1, t): (0.1, 0.0, 0.8) for t in (1, 2, 3)} | {(2, t): (0.3, 0.0, 0.6) for t in (1, 2, 3)})
    assert A.stage_repeat_share(rep) == 1.0 and A.stable_from(rep) == 1
    # layer 2 at recurrence 3 drifts onto layer 1's stage and layer 1 moves towards it
    drift = _rows({(1, 2): (0.1, 0.0, 0.8), (1, 3): (0.1, 0.0, 0.85), (2, 2): (0.3, 0.0, 0.6),
                   (2, 3): (0.1, 0.0, 0.81)})
    assert A.stage_repeat_share(drift) == 0.0  # every step now has the other layer nearest
    assert A.stable_from(drift) == 3  # recurrence 2 differs from 3 by more than 0.02 in some metric
    assert A.stage_repeat_share(_rows({(1, t): (0.1, 0.0, 0.8) for t in (1, 2, 3)})) is None  # one layer
    settle = _rows({(1, 1): (0.5, 0.0, 0.5), (1, 2): (0.11, 0.0, 0.8), (1, 3): (0.1, 0.0, 0.8)})
    assert A.stable_from(settle) == 2 and A.stable_from(settle, tol=0.001) == 3


def _fields(share, score, stable, rep, layers=2):
    return {"fixed_point_share": share, "degenerate_score": score, "stable_from": stable, "stage_repeat_share": rep,
            "loop_layers": layers, "stages": [{"layer": 1, "recurrence": 32}], "final_motion": 1e-4,
            "fixed_point_separation": None if score is None else 0.2}


def test_the_claims_by_hand():
    archs = {"looped-anchor": {"seeds": {"0": _fields(1.0, 0.5, 2, 1.0), "1": _fields(0.995, 0.9, 3, 0.95)}},
             "block": {"seeds": {"0": _fields(0.5, None, 9, None, 1), "1": _fields(1.0, None, 1, None, 1)}}}
    v = A.analysis_claims(archs)
    assert [ok for _, ok, _ in v] == [True, True, True, True, False, None, False, None]
    assert "100.0 / 99.5 % of tokens" in v[0][2] and "0.500 / 0.900; relative distance between the layers' fixed points 0.200 / 0.200, against a last-step motion of 1.0e-04 / 1.0e-04" in v[1][2] and "of recurrence 32" in v[2][0]
    archs["looped-anchor"]["seeds"]["1"] = _fields(0.98, 0.96, 4, 0.8)
    assert [ok for _, ok, _ in A.analysis_claims(archs)][:4] == [False, False, False, False]


def test_the_docs_give_the_committed_full_run():
    """docs/reproduce.md's analysis table and claim lines are the committed summary of the full run, row by row."""
    from helpers.common import REPO

    from hf_loops.evaluation.report import markdown_table
    from hf_loops.reproduce.cli import VERDICTS

    with open(os.path.join(REPO, "docs", "reproduce_analysis_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(REPO, "docs", "reproduce.md"), encoding="utf-8") as f:
        doc = f.read()
    for line in markdown_table(*A.analysis_table(summary["archs"])).splitlines():
        assert line in doc
    assert [c["held"] for c in summary["claims"]] == [ok for _, ok, _ in A.analysis_claims(summary["archs"])]
    for c in summary["claims"]:
        assert f"**{VERDICTS[c['held']]}:** {c['claim']} ({c['numbers']})" in doc
