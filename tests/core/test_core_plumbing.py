"""hf_loops.core: the commands' plumbing written once — readers that name file and line, number checks that keep an
explicit 0, the error boundary (exit 2 + one line for bad input, 1 for bugs), output directories with a lock."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from helpers.common import umask as _umask

from hf_loops.core import errors, numbers, readers
from hf_loops.core.outdir import TMP_PREFIX, atomic_output_dir, check_output_dir, lock_path, output_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTDIR = os.path.join(REPO, "hf_loops", "core", "outdir.py")


# --- readers ----------------------------------------------------------------------------------------------------------

def test_non_utf8_byte_is_named_with_file_line_and_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "a"}\n{"question": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        readers.read_jsonl(path)
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not UTF-8"):
        readers.read_text_lines(path)


@pytest.mark.parametrize("text, pattern", [
    ('{"a": 1}\n{"a": \n', r"x\.jsonl:2: invalid JSON \(column 7: Expecting value"),
    ('{"a": 1}\n\n[1, 2]\n', r"x\.jsonl:3: expected a JSON object \{\.\.\.\}, got a JSON list"),
    ('{"a": 1}\n"text"\n', r"x\.jsonl:2: expected a JSON object .*got a JSON string"),
    ("\n  \n", r"x\.jsonl' is empty"),
    ("[]", r"x\.jsonl' is an empty JSON list"),
    ("[1, 2, 3]", r"item 1 of the JSON list is a JSON number"),
    ('[{"a": 1},\n {"a": }]', r"x\.jsonl:2: invalid JSON"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, text, pattern):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        readers.read_jsonl(path)


def test_jsonl_rows_and_line_numbers(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\r\n')
    assert readers.read_jsonl(path) == ([{"a": 1}, {"a": 2}], [1, 3])
    path.write_text('[{"a": 1}, {"a": 2}]')
    assert readers.read_jsonl(path) == ([{"a": 1}, {"a": 2}], None)


def test_read_json_checks_the_type_and_reports_missing_and_loops(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"c\.json': expected a JSON object, got a JSON list"):
        readers.read_json(path, expect=dict)
    assert readers.read_json(path, expect=list) == [1, 2]
    with pytest.raises(ValueError, match=r"nowhere\.json' does not exist"):
        readers.read_json(tmp_path / "nowhere.json")
    with pytest.raises(ValueError, match=r"is a directory"):
        readers.read_text(tmp_path)
    loop = tmp_path / "loop.jsonl"
    os.symlink(loop, loop)  # a symlink to itself: ELOOP, the file's problem (never blamed on the Hub)
    with pytest.raises(ValueError, match=r"loop\.jsonl' cannot be read: Too many levels of symbolic links"):
        readers.read_jsonl(loop)
    dangling = tmp_path / "dangling.jsonl"
    os.symlink(tmp_path / "gone", dangling)
    with pytest.raises(ValueError, match="broken symbolic link"):
        readers.read_text(dangling)


# --- numbers ----------------------------------------------------------------------------------------------------------

def test_explicit_zero_is_a_value_not_a_missing_one():
    assert numbers.or_default(0, 16) == 0 and numbers.or_default(0.0, 1.5) == 0.0 and numbers.or_default(None, 3) == 3
    with pytest.raises(ValueError, match=r"--max-iterations must be an integer >= 1, got 0"):
        numbers.check_int("--max-iterations", numbers.or_default(0, 3), 1)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "1e-3", True, None])
def test_check_float_refuses_non_finite_and_non_numbers(value):
    with pytest.raises(ValueError, match=r"learning_rate must be a finite number >= 0, got"):
        numbers.check_float("learning_rate", value, 0)


def test_check_float_ranges_open_and_closed():
    assert numbers.check_float("x", 0, 0) == 0.0
    with pytest.raises(ValueError, match=r"grad_clip must be > 0, got -1"):
        numbers.check_float("grad_clip", -1, 0, low_open=True)
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\), got 1"):
        numbers.check_float("tau", 1, 0, 1, low_open=True, high_open=True)
    assert numbers.check_float("tau", 0.5, 0, 1, low_open=True, high_open=True) == 0.5


@pytest.mark.parametrize("value", [2.5, 2.0, True, "3", float("nan")])
def test_check_int_refuses_non_integers(value):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got"):
        numbers.check_int("max_new_tokens", value, 1)


# --- the error boundary -----------------------------------------------------------------------------------------------

def test_user_errors_exit_2_in_one_line_and_bugs_exit_1(capsys):
    def bad_value():
        raise ValueError("--foo must be >= 1, got 0\n(and a second line)")

    def full_disk():
        raise OSError(28, "No space left on device", "/out/model.safetensors")

    def bug():
        raise KeyError("oops")

    assert errors.run_command(bad_value) == 2
    assert capsys.readouterr().err.strip() == "error: --foo must be >= 1, got 0 (and a second line)"
    assert errors.run_command(full_disk) == 2
    assert capsys.readouterr().err.strip() == "error: /out/model.safetensors: No space left on device"
    assert errors.run_command(bug) == 1
    assert capsys.readouterr().err.strip() == "KeyError: 'oops' (rerun with --debug for the traceback)"
    with pytest.raises(KeyError):
        errors.run_command(bug, debug=True)
    assert errors.run_command(lambda: None) == 0 and errors.run_command(lambda: 3) == 3


def test_yaml_errors_are_user_errors(capsys):
    yaml = pytest.importorskip("yaml")

    def load():
        yaml.safe_load("a: !!python/object:os.system {}")

    assert errors.run_command(load) == 2
    assert capsys.readouterr().err.strip().startswith("error: recipe is not valid YAML")


# --- output directories -----------------------------------------------------------------------------------------------

def test_overwrite_swaps_a_complete_result_in_and_keeps_the_old_on_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ValueError, match=r"exists and is not empty \(1 entries: old\.txt\); expected a new or empty directory"):
        check_output_dir(out)
    with pytest.raises(RuntimeError), atomic_output_dir(str(out), overwrite=True) as tmp:
        open(os.path.join(tmp, "new.txt"), "w").write("new")
        raise RuntimeError("killed half-way")
    assert sorted(os.listdir(out)) == ["old.txt"]  # the earlier output is intact
    with atomic_output_dir(str(out), overwrite=True) as tmp:
        os.makedirs(os.path.join(tmp, "sub"))
        open(os.path.join(tmp, "sub", "new.txt"), "w").write("new")
    assert sorted(os.listdir(out)) == ["sub"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()  # normal modes, not mkdtemp's 0700
    assert stat.S_IMODE((out / "sub").stat().st_mode) == 0o777 & ~_umask()
    assert stat.S_IMODE((out / "sub" / "new.txt").stat().st_mode) == 0o666 & ~_umask()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary or lock file left


def test_the_lock_refuses_a_second_writer_and_is_reentrant_in_one_process(tmp_path):
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys
        import importlib.util
        # the stdlib-only module, loaded by path: no torch/transformers import in this process
        spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
        outdir = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(outdir)
        output_lock = outdir.output_lock
        try:
            with output_lock({str(out)!r}, "--output-dir"):
                print("got it")
        except ValueError as err:
            print(err)
    """)
    with output_lock(str(out), "--output-dir") as path:
        assert path == lock_path(str(out)) and open(path).read() == str(os.getpid())
        with output_lock(str(out)):  # the same process again (a command, then its export): no deadlock
            pass
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert f"is being written by another run (pid {os.getpid()})" in res.stdout, res.stdout + res.stderr
    assert not os.path.exists(lock_path(str(out)))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "got it"


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path, capsys):
    dead = tmp_path / f"{TMP_PREFIX}999999999_x"
    dead.mkdir()
    with atomic_output_dir(str(tmp_path / "out"), "--out") as tmp:
        json.dump({}, open(os.path.join(tmp, "eval.json"), "w"))
    assert not dead.exists() and "leftover of an interrupted" in capsys.readouterr().err


def test_a_refused_run_leaves_no_empty_parent_folders(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(ValueError, match="bad source"), output_lock(str(out)):
        assert (tmp_path / "a" / "b").is_dir()  # the lock lives beside the future directory
        raise ValueError("bad source")
    assert not (tmp_path / "a").exists()
    with atomic_output_dir(str(out), "--out") as tmp:
        open(os.path.join(tmp, "x.json"), "w").write("{}")
    assert sorted(os.listdir(out)) == ["x.json"] and os.listdir(tmp_path / "a" / "b") == ["out"]


def test_a_failed_write_into_a_new_nested_directory_leaves_nothing(tmp_path):
    out = tmp_path / "x" / "y" / "out"
    with pytest.raises(OSError), atomic_output_dir(str(out), "--out") as tmp:
        open(os.path.join(tmp, "part.bin"), "wb").write(b"1")
        raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == []
