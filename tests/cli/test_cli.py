"""`hf-loops` command line."""

import json
import os

from helpers.tah2_helpers import tiny_qwen3
from transformers import AutoModelForCausalLM

from hf_loops.cli import main


def test_demo_prints_tokens_with_depths(capsys):
    assert main(["demo", "--random", "--max-new-tokens", "5", "--max-iterations", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 5
    assert all(row[2] in {"1", "2"} for row in rows)
    assert "mean depth" in out


def test_convert_command_writes_loadable_checkpoint(tmp_path, capsys):
    q = tiny_qwen3()
    q.save_pretrained(tmp_path / "q")
    rc = main(["convert", str(tmp_path / "q"), "--arch", "tah2", "--out", str(tmp_path / "t"),
               "--set", "max_iterations=3", "--set", "exit_threshold=0.6"])
    assert rc == 0
    cfg = json.load(open(tmp_path / "t" / "config.json"))
    assert cfg["max_iterations"] == 3 and cfg["exit_threshold"] == 0.6 and "auto_map" in cfg
    assert os.path.isfile(tmp_path / "t" / "modeling_tah2.py")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    assert type(model).__name__ == "TaH2ForCausalLM"
    assert "wrote" in capsys.readouterr().out


def test_convert_command_reports_bad_values(tmp_path, capsys):
    q = tiny_qwen3()
    q.save_pretrained(tmp_path / "q")
    rc = main(["convert", str(tmp_path / "q"), "--arch", "tah2", "--out", str(tmp_path / "t"),
               "--set", "max_iterations=0"])
    assert rc == 2
    assert "max_iterations" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
