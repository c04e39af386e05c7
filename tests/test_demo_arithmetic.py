"""`hf-loops demo --task arithmetic`: aggregation over seeds, the table, the verdict, the CLI plumbing."""

import json
import os

import pytest

from hf_loops.data import arithmetic as A
from hf_loops.demo import arithmetic_task, runs, settings, stats
from hf_loops.demo.settings import RunJob


def _run(seed, em, nll, flops, train, depth=None, shares=None):
    m = {"exact_match": em, "answer_nll": nll, "decode_flops_per_token": flops, "mean_depth": depth,
         "mean_depth_generated": depth}
    cs = {c: {"tokens": 10, "mean_depth": 1.0, "deep_share": (shares or {}).get(c, 0.0)} for c in A.TOKEN_CLASSES}
    return {"seed": seed, "metrics": m, "train_runtime": train, "class_shares": cs}


def _runs():
    return {
        "standard": [_run(0, 0.10, 1.0, 100.0, 10.0), _run(1, 0.20, 1.2, 100.0, 20.0)],
        "tah2": [_run(0, 0.30, 0.9, 150.0, 25.0, 1.5, {"carry digits": 0.8}),
                 _run(1, 0.10, 1.1, 130.0, 30.0, 1.3, {"carry digits": 0.6})],
        "tah2-fixed": [_run(0, 0.20, 0.95, 200.0, 30.0, 2.0), _run(1, 0.20, 1.0, 200.0, 40.0, 2.0)],
    }


def test_aggregate_takes_ratios_seed_by_seed_and_the_table_shows_mean_and_std():
    agg = stats.aggregate(_runs())
    assert [r["flops_ratio"] for r in agg["tah2"]] == [1.5, 1.3]
    assert [r["train_ratio"] for r in agg["tah2"]] == [2.5, 1.5]
    assert [r["mean_depth"] for r in agg["standard"]] == [1.0, 1.0]  # no loop: depth 1
    headers, rows = stats.seed_table(agg)
    assert rows[0][0].startswith("Standard") and rows[1][0].startswith("TaH2 ")
    assert rows[1][1] == "20.0 ± 14.1 %"  # mean 20 %, sample std of (30, 10) = 14.14
    assert rows[1][5] == "1.40 ± 0.14×"
    ch, crows = stats.class_table(agg)
    assert dict((r[0], r[2]) for r in crows)["carry digits"] == "70.0 ± 14.1 %"


def test_verdict_says_not_held_unless_ahead_in_every_seed():
    agg = stats.aggregate(_runs())
    text = "\n".join(stats.verdict(agg))
    assert "ahead in 1 of 2 seeds" in text and "did **not** hold" in text
    runs = _runs()
    runs["tah2"][1]["metrics"]["exact_match"] = 0.5
    assert "held on this task, in every seed" in "\n".join(stats.verdict(stats.aggregate(runs)))


def test_run_jobs_refuses_zero_workers_and_starts_the_deeper_runs_first():
    with pytest.raises(ValueError, match="--workers"):
        runs.run_jobs([], workers=0)
    jobs = [RunJob(task="arithmetic", base="b", arch=a, seed=0, settings={"max_steps": 5}, train_file="t",
                   heldout="h", ckpt="c", batch_size=1, max_new_tokens=1) for a in ("standard", "tah2", "standard")]
    assert [runs._job_cost(j) for j in jobs] == pytest.approx([800.0, 1840.0, 800.0])
    assert 1 <= runs.default_workers() <= 2


def test_plot_writes_a_png(tmp_path):
    arithmetic_task.plot_em_vs_flops(stats.aggregate(_runs()), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    arithmetic_task.plot_class_shares(stats.aggregate(_runs()), str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_cli_refuses_arithmetic_with_a_custom_dataset(tmp_path, capsys):
    from hf_loops.demo.cli import main

    assert main(["--task", "arithmetic", "--dataset", "x.jsonl", "--out", str(tmp_path / "o")]) == 2
    assert "--task arithmetic" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
    assert main(["--task", "arithmetic", "--seeds", "0", "--out", str(tmp_path / "o")]) == 2


@pytest.mark.slow
def test_run_arithmetic_demo_end_to_end_tiny(tmp_path):
    res = arithmetic_task.run_arithmetic_demo(str(tmp_path / "out"), seeds=(0,), steps=1, max_new_tokens=4,
                                sizes={"n_train": 8, "n_validation": 2, "n_heldout": 3},
                                training={"per_device_train_batch_size": 2}, workers=2)
    files = set(os.listdir(tmp_path / "out"))
    assert {"report.md", "runs.json", "em_vs_flops.png", "deep_share_by_class.png", "depth_map.png", "data"} <= files and "runs" not in files
    with open(tmp_path / "out" / "runs.json") as f:
        runs = json.load(f)["runs"]
    assert sorted(runs) == ["standard", "tah2", "tah2-fixed"]
    assert runs["tah2-fixed"][0]["metrics"]["mean_depth"] == 2.0
    assert "did **not** hold" in (tmp_path / "out" / "report.md").read_text() or "held on" in (
        tmp_path / "out" / "report.md").read_text()
    assert len(res["table"][1]) == 3
    # every run read only its steps × batch problems (the split on disk keeps all 8)
    assert len(open(tmp_path / "out" / "data" / "train.jsonl").readlines()) == 8


def test_cpu_summary_means_per_arch_and_totals_every_phase():
    runs = {"standard": [{"cpu_seconds": {"startup": 8.0, "train": 20.0, "evaluate": 2.0}},
                         {"cpu_seconds": {"startup": 0.0, "train": 22.0, "evaluate": 4.0}}],
            "tah2": [{"cpu_seconds": {"startup": 0.0, "train": 40.0, "evaluate": 6.0}}, {"cpu_seconds": None}]}
    s = stats.cpu_summary(runs)
    assert s["per_run_mean"]["standard"] == {"startup": 4.0, "train": 21.0, "evaluate": 3.0}
    assert s["per_run_mean"]["tah2"] == {"startup": 0.0, "train": 40.0, "evaluate": 6.0}
    assert s["total"] == 102.0  # 30 + 26 + 46; a run without timings adds nothing


def test_run_names_come_from_the_architecture_registry():
    from hf_loops.conversion.registry import display_name
    from hf_loops.modeling.configuration_tah2 import TAH2_PRESETS, TaH2Config

    assert dict(settings.ARCHS) == {"standard": "Standard (M=1)", "tah2": "TaH2 (M=2)", "tah2-fixed": "TaH2-fixed (M=2)"}
    for preset in ("standard", "tah2", "tah2-fixed"):  # the same name a trained checkpoint's config gets
        cfg = TaH2Config(**{"max_iterations": 2, **TAH2_PRESETS[preset]})
        assert settings.arch_label(preset) == display_name(cfg)
    assert settings.arch_label("tah2", 3) == "TaH2 (M=3)"
