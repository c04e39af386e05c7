"""`hf-loops analyze` on tiny converted models of every architecture: figures, metrics.json and report.md are written
atomically; bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.common import tiny_qwen3_config
from transformers import Qwen3ForCausalLM

from hf_loops.cli import main
from hf_loops.conversion import convert_qwen3

pytest.importorskip("matplotlib")

TEXTS = ["--text", "The square root of 16 is", "--text", "Hello! I've been well."]
FAST = ["--tokenizer", "bytes", "--grouping", "none", "--fixed-point-recurrences", "6", "--no-progress"]

ARCHS = {
    "tah2": dict(max_iterations=2),
    "spiralformer": dict(num_pre_layers=0, num_loop_layers=1, num_post_layers=1, chunk_sizes=[2, 1],
                         topology="mesh"),
    "looped": dict(num_pre_layers=0, num_loop_layers=1, num_post_layers=1, chunk_sizes=[1, 1], topology="anchor",
                   core_output="delta"),
    "sgt": dict(loop_plan=[{"layer": 1, "heads": [0, 2], "depth": 1}]),
}
# metric groups per run (every group is exercised on some architecture; few figures keep the test fast)
METRICS = {"tah2": ["attention", "depth"], "spiralformer": ["attention"], "looped": ["fixed_point", "attention"],
           "sgt": ["residual", "attention"]}
EXPECTED = {
    "tah2": ["cross_iteration_mass", "decider_gain_alignment", "forced_depth_loss_change", "entropy_none"],
    "spiralformer": ["coarse_to_fine", "colsum_concentration_none", "sink_rate_none"],
    "looped": ["fixed_point_distance", "fixed_point_cosine", "limiting_behaviour", "attention_distance_fixed_point"],
    "sgt": ["residual_successive_l2", "residual_norm_mean_none", "attention_distance_successive"],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=256)).eval()
    paths = {}
    for name, kw in ARCHS.items():
        arch = "spiralformer" if name == "looped" else name
        model = convert_qwen3(qwen, arch, **kw)
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
    return paths


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.slow
def test_analyze_writes_figures_metrics_and_report(checkpoints, tmp_path, name):
    out = tmp_path / "out"
    assert main(["analyze", checkpoints[name], *TEXTS, *FAST, "--metrics", *METRICS[name], "--out", str(out)]) == 0
    files = set(os.listdir(out))
    assert {"metrics.json", "report.md"} <= files
    metrics = json.loads((out / "metrics.json").read_text())
    report = (out / "report.md").read_text()
    for stem in EXPECTED[name]:
        assert stem in metrics["figures"], stem
        for ext in ("png", "svg"):
            assert (out / f"{stem}.{ext}").stat().st_size > 0
        assert f"`{stem}." in report
    assert metrics["inputs"]["sequences"] == 2
    assert all(not f.startswith(".") for f in os.listdir(tmp_path))  # no temporary sibling left behind
    if name == "looped":
        assert metrics["findings"]["fixed_point"]["verdict"] in (
            "no fixed point", "degenerate fixed point", "cyclic fixed points",
            "fixed point (one loop layer: degenerate vs cyclic undecidable)")
        assert "fixed point" in report
    if name == "spiralformer":
        assert "coarse to fine" in report
        assert metrics["coarse_to_fine"]["resolutions"] == [0.5, 1.0]


def test_analyze_bad_input_exits_2(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["analyze", str(tmp_path / "missing"), *TEXTS, *FAST, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\nnot json\n')
    assert main(["analyze", checkpoints["sgt"], "--dataset", str(bad), *FAST, "--out", str(out)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["analyze", checkpoints["sgt"], *TEXTS, *FAST, "--recurrences", "0", "--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.slow
def test_analyze_refuses_non_empty_out_unless_overwrite(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    args = ["analyze", checkpoints["sgt"], "--text", "abc def", *FAST, "--metrics", "attention", "--out", str(out)]
    assert main(args) == 2
    assert "not empty" in capsys.readouterr().err and (out / "old.txt").exists()
    assert main(args + ["--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "metrics.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]
