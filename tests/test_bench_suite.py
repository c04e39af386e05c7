"""The benchmark suite's smallest run writes every row it was asked for, in the JSON and markdown layout the README
and the lead's tables read. No timing assertions: a row may miss its goal (or error) and still be well formed."""

import json
import os
import statistics

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ["tah2-eff-b1", "tah2-kv-b8", "tah2-gen-eff-b1", "tah2-gen-pass-eff-b1", "tah2-sft", "sgt-train", "block-train", "spiral-prefill", "spiral-core-passes"]


@pytest.mark.slow
def test_quick_run_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(ROOT)  # `bench` lives at the repository root, next to the package
    from bench.cli import main

    threads = torch.get_num_threads()  # in-process (no second import of transformers), threads and RNG left as found
    with torch.random.fork_rng(devices=[]):
        main(["all", "--quick", "--repeats", "1", "--threads", str(threads), "--rows", ",".join(ROWS),
              "--out", str(tmp_path), "--stem", "smoke"])
    assert torch.get_num_threads() == threads
    data = json.loads((tmp_path / "smoke.json").read_text())
    settings = data["settings"]
    for key in ("device", "dtype", "threads", "torch", "transformers", "workload", "sizes", "elapsed_s", "clock",
                "load_avg_start", "load_avg_end"):
        assert key in settings, key
    assert settings["device"] == "cpu" and settings["quick"] and list(settings["sizes"]) == ["tiny"]
    ids = [r["id"] for r in data["rows"]]
    assert sorted(ids) == sorted(ROWS)  # every wanted row reported once, missed or not
    for r in data["rows"]:
        assert set(r) >= {"id", "name", "size", "goal", "measured", "met", "note"}
        assert r["met"] in {"yes", "no", "reported", "error"}
        assert (r["measured"] is None) == (r["met"] == "error"), r
    sft = next(r for r in data["rows"] if r["id"] == "tah2-sft")
    if sft["met"] != "error":  # --quick keeps the asked repeats; the median is of the per-repeat (back-to-back) ratios
        extra = sft["extra"]
        pairs = [t / s for s, t in zip(extra["repeat_seconds"]["standard"], extra["repeat_seconds"]["tah2"], strict=True)]
        assert extra["repeats"] == len(pairs) == 1 and extra["median_ratio"] == pytest.approx(statistics.median(pairs))
        assert f"median of the per-repeat ratios {extra['median_ratio']:.3f}×" in sft["note"]
    passes = next(r for r in data["rows"] if r["id"] == "tah2-gen-pass-eff-b1")
    if passes["met"] != "error":  # tokens/s ratio ÷ ((new − 1) Standard steps ÷ the largest per-row Σ depth)
        c = passes["extra"]["continuous"]
        decoded = round(c["tokens_per_s"] * c["seconds"])  # batch 1: new − 1 tokens, and the passes are its Σ depth
        assert c["pass_bound"] == pytest.approx(decoded / c["steps"])
        assert passes["measured"] == pytest.approx(c["tps_ratio"] / c["pass_bound"])
    md = (tmp_path / "smoke.md").read_text().splitlines()
    header = "| row | size | goal | measured | met? | note |"
    assert header in md
    table = [line for line in md if line.startswith("| ") and line != header]
    assert len(table) == len(ROWS) and all(line.count("|") == 7 for line in table)
    assert header in capsys.readouterr().out  # the table is printed too


def test_clock_choice_and_spread(monkeypatch):
    """`--clock cpu` times with the process's CPU time (a busy loop counts, a sleep does not); a bad name is refused;
    the spread is slowest ÷ fastest − 1."""
    import time

    monkeypatch.syspath_prepend(ROOT)
    from bench import common

    try:
        common.set_clock("cpu")
        assert common.clock_name() == "cpu"
        secs, _ = common.timed("cpu", lambda: time.sleep(0.2))
        assert secs < 0.1
        common.set_clock("wall")
        secs, _ = common.timed("cpu", lambda: time.sleep(0.05))
        assert secs >= 0.05
        try:
            common.set_clock("gpu")
        except ValueError as exc:
            assert "clock" in str(exc)
        else:
            raise AssertionError("set_clock accepted 'gpu'")
    finally:
        common.set_clock("wall")
    assert common.spread([2.0, 3.0, 2.5]) == 0.5 and common.spread([1.0]) == 0.0


@pytest.mark.slow
def test_profile_generate_ops_counts_the_decode_only(monkeypatch, capsys):
    """`python -m bench.profile_generate --ops` times every op of one decode per model with the prefill's ops left
    out: Standard's decode runs one layer-stack pass per new token after the first, so its matmul calls are a
    multiple of those tokens, and the final line compares matmul speed per FLOP."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import common, profile_generate

    threads, clock = torch.get_num_threads(), common.clock_name()
    try:
        with torch.random.fork_rng(devices=[]):
            profile_generate.main(["--size", "tiny", "--batch", "2", "--repeats", "1", "--new", "5", "--ops",
                                   "--threads", str(threads)])
    finally:  # the tool sets the process's clock and threads, as a command should
        torch.set_num_threads(threads)
        common.set_clock(clock)
    out = capsys.readouterr().out
    std = next(line for line in out.splitlines() if line.startswith("== standard (ops timed, decode only)"))
    calls = int(std.split(" calls")[0].rsplit(" ", 1)[1])
    assert calls > 0 and calls % 4 == 0  # 4 decode forwards (new − 1), the same matmuls each
    assert "TaH2's matmuls run at" in out.splitlines()[-1]


@pytest.mark.slow
def test_quick_quantized_rows(tmp_path, monkeypatch):
    """`python -m bench quant` (docs/quantization.md) at --quick: every arch × scheme gets its NLL row, TaH2 its GPTQ
    rows, and TaH2 and SpiralFormer their speed rows, well formed; NLL rows on the embedded base keep their stated bounds (int8 1 %,
    int4 3 %)."""
    pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")
    monkeypatch.syspath_prepend(ROOT)
    from bench.cli import main

    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        main(["quant", "--quick", "--repeats", "1", "--threads", str(threads), "--out", str(tmp_path), "--stem", "q"])
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    names = [r["name"] for r in rows]
    for arch in ("tah2", "spiralformer", "sgt"):
        for scheme in ("int8", "int4"):
            assert f"{arch} {scheme} NLL ÷ fp32" in names, names
    for arch in ("tah2", "spiralformer"):
        assert any(n.startswith(f"{arch} int8 generate tokens/s") for n in names), names
    for r in rows:
        assert r["met"] in {"yes", "no", "reported", "error"} and (r["measured"] is None) == (r["met"] == "error"), r
    nll = [r for r in rows if "NLL ÷ fp32" in r["name"] and "GPTQ" not in r["name"]]
    assert all(r["met"] == "yes" for r in nll), [(r["name"], r["measured"]) for r in nll]
    gptq = {r["name"]: r for r in rows if "GPTQ" in r["name"]}
    assert sorted(gptq) == [f"tah2 {s} GPTQ (every depth) NLL ÷ fp32" for s in ("int4", "int8")], sorted(gptq)
    for r in gptq.values():  # measured against round-to-nearest and depth-1-only calibration, judged on its goal
        assert r["met"] in {"yes", "no"} and set(r["extra"]) == {"rtn", "all", "first"}, r


def test_quick_kv_quant_rows(tmp_path, monkeypatch):
    """`python -m bench kv-quant` (docs/quantization.md "Quantized loop cache") at --quick: an int8 and an int4 row per
    architecture, well formed, with bytes ÷ fp32 ordered int4 < int8 < 1 and the greedy agreement in the note."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import kv_quant
    from bench.cli import main

    monkeypatch.setattr(kv_quant, "_done", set())
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        main(["kv-quant", "--quick", "--threads", str(threads), "--out", str(tmp_path), "--stem", "kvq"])
    torch.set_num_threads(threads)
    rows = {r["id"]: r for r in json.loads((tmp_path / "kvq.json").read_text())["rows"]}
    for arch in ("tah2", "spiralformer", "sgt"):
        int8, int4 = rows[f"kvq-{arch}-int8"], rows[f"kvq-{arch}-int4"]
        assert int8["met"] in {"yes", "no"} and int4["met"] == "reported", (int8, int4)
        assert 0 < int4["measured"] < int8["measured"] < 1
        assert "of rows identical to the fp cache" in int8["note"] and 0 <= int8["extra"]["rows_identical"] <= 1
