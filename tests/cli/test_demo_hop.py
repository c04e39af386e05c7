"""`hf-loops demo --task hop` (what `make demo` runs): the whole pipeline from the embedded 1-hop base with 3 training
steps per run, 2 seeds and 8 held-out problems (the real demo's numbers are in docs/demo_summary.json, timed by
`make demo`, not tested here); the summary's shape, the kept checkpoints, `hf-loops eval --task hop --json` giving the
demo's numbers on the same problems, and the claim tests on hand-made summaries."""

import json
import os

import pytest

from hf_loops.cli import main
from hf_loops.data import hop_base_dir
from hf_loops.demo import hop
from hf_loops.demo.settings import HOP_MODEL, HOP_SPEC, HopOptions, hop_settings
from hf_loops.evaluation.tasks import DEPTH_SUMMARY_FIELDS

ARCHS = ("standard", "tah2", "tah2-fixed")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("hopdemo")
    out = root / "demo_out"
    result = hop.run_hop_demo(str(out), options=HopOptions(seeds=(0, 1), steps=3, n_heldout=8), workers=2)
    return {"root": root, "out": out, "result": result}


@pytest.mark.slow
def test_summary_has_exactly_the_issue_shape(demo):
    summary = json.loads((demo["out"] / "summary.json").read_text())
    assert list(summary) == ["tasks"] and list(summary["tasks"]) == ["hop"]
    task = summary["tasks"]["hop"]
    assert list(task) == ["archs"] and sorted(task["archs"]) == sorted(ARCHS)
    for arch in ARCHS:
        seeds = task["archs"][arch]["seeds"]
        assert sorted(seeds) == ["0", "1"]
        for fields in seeds.values():
            assert list(fields) == list(DEPTH_SUMMARY_FIELDS)
            assert 0 <= fields["exact_match"] <= 1 and fields["answer_nll"] > 0
            assert list(fields["by_difficulty"]) == ["copy", "1", "2"]
            for level in fields["by_difficulty"].values():
                assert set(level) == {"accuracy", "deep_share", "tokens"} and level["tokens"] > 0
            # 8 problems × 4 queries: every result letter is one token of the character tokenizer
            assert fields["by_difficulty"]["1"]["tokens"] + fields["by_difficulty"]["2"]["tokens"] == 32
    for seed in ("0", "1"):
        std = task["archs"]["standard"]["seeds"][seed]
        assert std["train_time_ratio"] == 1.0 and std["decode_flops_ratio"] == pytest.approx(1.0)
        assert std["mean_depth"] == 1 and std["by_difficulty"]["2"]["deep_share"] == 0.0
        fixed = task["archs"]["tah2-fixed"]["seeds"][seed]
        assert fixed["mean_depth"] == 2 and fixed["by_difficulty"]["copy"]["deep_share"] == 1.0
        tah = task["archs"]["tah2"]["seeds"][seed]
        assert 1 <= tah["mean_depth"] <= 2 and tah["train_time_ratio"] > 0


@pytest.mark.slow
def test_the_seed0_checkpoints_stay_and_load_with_auto_classes(demo):
    from transformers import AutoModelForCausalLM

    root = demo["out"] / "hop"
    assert {f"{a}-seed0" for a in ARCHS} <= set(os.listdir(root))
    assert not (root / "runs").exists() and not (root / "tah2-seed1").exists()
    assert not [p for p in os.listdir(demo["root"]) if ".tmp-" in p]  # written atomically
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(root / f"{arch}-seed0")
        if arch != "standard":
            assert model.config.updater == HOP_MODEL["updater"] and model.config.max_iterations == 2
        assert json.loads((root / f"{arch}-seed0" / "train_summary.json").read_text())["steps"] == 3
    # every run post-trained on the same max_steps × batch problems
    assert len((root / "data" / "train.jsonl").read_text().splitlines()) == 3 * 64
    for name in ("accuracy_by_difficulty.png", "deep_share_by_difficulty.png", "depth_map.png", "runs.json"):
        assert (root / name).stat().st_size > 1000, name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["standard", "tah2"])
def test_hf_loops_eval_task_hop_gives_the_demo_numbers_on_the_same_problems(demo, capsys, arch):
    """The held-out split is the test split of data seed 0: `hf-loops eval --task hop --data-seed 0 --n 8 --json`
    scores the same problems, exactly as the demo did."""
    capsys.readouterr()
    ckpt = demo["out"] / "hop" / f"{arch}-seed0"
    assert main(["eval", str(ckpt), "--task", "hop", "--data-seed", "0", "--n", "8", "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = json.loads((demo["out"] / "summary.json").read_text())["tasks"]["hop"]["archs"][arch]["seeds"]["0"]
    assert got["train_time_ratio"] is None
    assert {k: v for k, v in got.items() if k != "train_time_ratio"} == {
        k: v for k, v in want.items() if k != "train_time_ratio"}


@pytest.mark.slow
def test_report_holds_the_tables_and_the_claim_tests(demo):
    report = (demo["out"] / "report.md").read_text()
    task = json.loads((demo["out"] / "summary.json").read_text())["tasks"]["hop"]
    for table in (hop.summary_table(task), hop.difficulty_table(task)):
        for row in table[1]:
            assert "| " + " | ".join(row) + " |" in report
    assert report.count("- **held:**") + report.count("- **did not hold:**") == 3
    assert "--task hop --data-seed 1 --n 200 --json" in report


def _fields(em, flops=1.0, deep=None, acc=1.0):
    deep = deep or {"copy": 0.0, "1": 0.0, "2": 0.0}
    return {"exact_match": em, "answer_nll": 0.1, "mean_depth": 1.0, "generated_depth": 1.0,
            "decode_flops_ratio": flops, "train_time_ratio": 1.0,
            "by_difficulty": {lv: {"accuracy": acc, "deep_share": deep[lv], "tokens": 10} for lv in HOP_SPEC.levels}}


def _task(std, tah, fixed, tah_flops=1.5, fixed_flops=2.0, deep=None):
    return {"archs": {
        "standard": {"seeds": {str(i): _fields(v) for i, v in enumerate(std)}},
        "tah2": {"seeds": {str(i): _fields(v, tah_flops, deep) for i, v in enumerate(tah)}},
        "tah2-fixed": {"seeds": {str(i): _fields(v, fixed_flops) for i, v in enumerate(fixed)}}}}


def test_claims_by_hand():
    deep = {"copy": 0.1, "1": 0.2, "2": 0.9}
    held = hop.claims(_task([0.1, 0.1, 0.1], [0.9, 0.95, 1.0], [0.5, 0.5, 0.5], deep=deep))
    assert [ok for _, ok, _ in held] == [True, True, True]
    assert "ahead in 3 of 3 seeds; gain +85.0 points" in held[0][2]
    assert "ratio 0.50" in held[1][2] and "(9.0×)" in held[2][2]
    # one seed behind; TaH2 spends 0.6 of fixed's extra FLOPs + ε; copy share one third of level 2's + ε
    failed = hop.claims(_task([0.1, 0.1, 0.5], [0.9, 0.95, 0.4], [0.5, 0.5, 0.5], tah_flops=1.61,
                              deep={"copy": 0.31, "1": 0.3, "2": 0.9}))
    assert [ok for _, ok, _ in failed] == [False, False, False]
    # a mean gain under twice the larger std fails even when TaH2 is ahead in every seed
    assert hop.claims(_task([0.0, 0.0, 0.0], [0.1, 0.5, 0.9], [0.0] * 3))[0][1] is False
    # TaH2-fixed below Standard: any TaH2 gain at least as large counts as all of it
    assert hop.claims(_task([0.1] * 3, [0.9] * 3, [0.0] * 3))[1][1] is True


def test_settings_refuse_bad_steps_and_keep_the_warm_up_a_third():
    assert hop_settings()["max_steps"] == 120 and hop_settings()["base_warmup_steps"] == 40
    assert hop_settings(30)["base_warmup_steps"] == 10
    assert hop_settings(30, {"base_warmup_steps": 0})["base_warmup_steps"] == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--steps"):
            hop_settings(bad)


@pytest.mark.parametrize("argv, flag", [
    (["--task", "hop", "--base", "x"], "--base"),
    (["--task", "hop", "--heldout", "0"], "--heldout"),
    (["--task", "hop", "--max-iterations", "3"], "--max-iterations"),
    (["--task", "hop", "--steps", "0"], "--steps"),
])
def test_bad_demo_flags_are_one_line(tmp_path, capsys, argv, flag):
    assert main(["demo", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]
    assert not (tmp_path / "o").exists()


def test_the_embedded_hop_base_is_a_small_qwen3_that_knows_one_hop():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hop_base_dir())
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 2
    size = sum(os.path.getsize(os.path.join(hop_base_dir(), f)) for f in os.listdir(hop_base_dir()))
    assert size < 8 * 2**20


@pytest.mark.slow
def test_the_embedded_hop_base_answers_one_hop_and_guesses_two(capsys):
    """The base's report holds: every 1-hop problem right (100 % at step 1,000 of its pretraining); 2-hop letters
    near chance (1/7), which is what post-training has to add."""
    capsys.readouterr()
    assert main(["eval", hop_base_dir(), "--task", "hop", "--max-hops", "1", "--n", "20", "--json",
                 "--no-progress"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["exact_match"] == 1.0 and one["by_difficulty"]["1"]["accuracy"] == 1.0
    assert main(["eval", hop_base_dir(), "--task", "hop", "--n", "20", "--json", "--no-progress"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert two["by_difficulty"]["1"]["accuracy"] == 1.0 and two["by_difficulty"]["2"]["accuracy"] < 0.3
