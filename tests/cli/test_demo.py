"""`hf-loops demo`: the whole pipeline on a tiny random base and 16 problems with 2 training steps per run (the real
`make demo` uses the embedded base and the vendored GSM8K problems; it is timed, not tested here)."""

import json
import os

import numpy as np
import pytest
from helpers.eval_helpers import tiny_base, write_problems
from helpers.picture_helpers import chromium_render_check, expected_colors, png_box_counts

from hf_loops.cli import main
from hf_loops.demo.gsm8k import run_demo, split_rows
from hf_loops.evaluation.report import comparison_rows


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    base = tiny_base(root / "base")
    data = write_problems(root / "problems.jsonl", n=16)
    out = root / "demo_out"
    result = run_demo(base=base, dataset=data, out=str(out), heldout=4, steps=2, max_new_tokens=8, batch_size=4,
                      training={"max_length": 96, "per_device_train_batch_size": 4}, progress=False, seeds=(0, 1),
                      workers=2)
    return {"root": root, "base": base, "data": data, "out": out, "result": result}


def test_split_holds_out_the_last_rows_or_the_given_ones():
    rows = list(range(10))
    assert split_rows(rows, 3) == (list(range(7)), [7, 8, 9])
    assert split_rows(rows, 0, heldout_rows=[0, 5]) == ([1, 2, 3, 4, 6, 7, 8, 9], [0, 5])
    with pytest.raises(ValueError, match="--heldout"):
        split_rows(rows, 10)


@pytest.mark.slow
def test_demo_writes_report_checkpoints_and_data(demo):
    out = demo["out"]
    assert {"report.md", "eval.json", "depth_map.html", "depth_map.png", "loss_curves.png",
            "depth_by_token_class.png", "standard", "tah2", "data"} <= set(os.listdir(out))
    assert not [p for p in os.listdir(demo["root"]) if ".tmp-" in p]  # written atomically
    assert len(open(out / "data" / "train.jsonl").readlines()) == 12
    assert len(open(out / "data" / "heldout.jsonl").readlines()) == 4
    for run in ("standard", "tah2"):
        summary = json.loads((out / run / "train_summary.json").read_text())
        assert summary["steps"] == 2 and summary["train_runtime"] > 0
        assert [h["step"] for h in summary["log_history"] if "ntp_loss" in h] == [1, 2]
    assert json.loads((out / "tah2" / "train_summary.json").read_text())["decider_acc"] is not None
    results = json.loads((out / "eval.json").read_text())["results"]
    assert [r["name"] for r in results] == ["Standard (M=1)", "TaH2 (M=2)"]
    report = (out / "report.md").read_text()
    headers, rows = comparison_rows(results)
    for row in rows:  # the table holds this run's measured numbers
        assert "| " + " | ".join(row) + " |" in report
    m = results[1]["metrics"]
    assert f"{m['mean_depth']:.3f}" in report and "digits/operators" in report and "Decider accuracy" in report
    assert "does **not** beat" in report or "TaH2 is lower" in report
    assert demo["result"]["table"].splitlines()[0].startswith("run")


@pytest.mark.slow
def test_demo_trains_every_seed_and_reports_mean_and_spread(demo):
    """Two seeds on two workers: the seed table holds both seeds' numbers; only the first seed's checkpoints stay."""
    from hf_loops.demo.stats import seed_table

    saved = json.loads((demo["out"] / "eval.json").read_text())
    agg = saved["seed_runs"]
    assert [r["seed"] for r in agg["standard"]] == [0, 1] and [r["seed"] for r in agg["tah2"]] == [0, 1]
    assert agg["standard"][0]["answer_nll"] == saved["results"][0]["metrics"]["answer_nll"]  # seed 0 = the detail
    assert agg["tah2"][0]["mean_depth"] == saved["results"][1]["metrics"]["mean_depth"]
    assert all(r["flops_ratio"] == 1.0 for r in agg["standard"])
    headers, rows = seed_table(agg)
    assert [list(r) for r in demo["result"]["seed_table"][1]] == rows
    report = (demo["out"] / "report.md").read_text()
    assert "Mean ± std over 2 seed(s) (0, 1)" in report and "| " + " | ".join(rows[1]) + " |" in report
    assert not (demo["out"] / "runs").exists()
    # process CPU seconds per run and phase (every run trains and evaluates), and their total in the report
    cpu = saved["cpu_seconds"]
    assert set(cpu["per_run_mean"]) == {"standard", "tah2"} and cpu["total"] > 0
    assert all(v["train"] > 0 and v["evaluate"] > 0 for v in cpu["per_run_mean"].values())
    assert f"GSM8K {cpu['total']:.0f} s" in report


@pytest.mark.slow
def test_pictures_are_not_blank_and_colour_every_token(demo):
    from matplotlib.image import imread

    out = demo["out"]
    tah = json.loads((out / "eval.json").read_text())["results"][1]
    shown = tah["examples"][:4]  # the PNG shows the first 4 held-out answers
    counts = png_box_counts(out / "depth_map.png", 2)
    for d in (1, 2):
        want = sum(e["answer_depths"].count(d) for e in shown)
        assert counts[d] == want + 1, (d, counts)  # + the legend patch
    for name in ("loss_curves.png", "depth_by_token_class.png"):
        img = imread(out / name)[..., :3]
        ink = (img < 0.9).any(-1).mean()
        assert 0.01 < ink < 0.6, (name, ink)
        orange = (np.abs(img * 255 - np.array([0xC4, 0x4E, 0x12])) < 8).all(-1).sum()
        assert orange > 50, name  # the TaH2 run is drawn
    check = chromium_render_check(out / "depth_map.html")
    n = sum(len(e["answer_tokens"]) for e in tah["examples"])
    assert check["tokens"] == check["visible"] == check["titled"] == n
    want = expected_colors(2)
    for d, colors in check["colors"].items():
        assert list(colors) == [want[d]]


@pytest.mark.slow
def test_hf_loops_eval_on_the_demo_checkpoints_reproduces_the_table(demo, tmp_path, capsys):
    argv = demo["result"]["eval_command"].split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "ev")
    assert main(argv + ["--no-progress"]) == 0
    again = json.loads((tmp_path / "ev" / "eval.json").read_text())["results"]
    first = json.loads((demo["out"] / "eval.json").read_text())["results"]
    assert comparison_rows(again)[1] == comparison_rows(first)[1]
    assert demo["result"]["table"] in capsys.readouterr().out


@pytest.mark.slow
def test_demo_refuses_a_non_empty_out(demo, capsys):
    assert main(["demo", "--base", demo["base"], "--dataset", demo["data"], "--out", str(demo["out"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0]
    assert main(["demo", "--base", demo["base"], "--dataset", demo["data"], "--heldout", "99",
                 "--out", str(demo["root"] / "z")]) == 2
    assert "--heldout" in capsys.readouterr().err
