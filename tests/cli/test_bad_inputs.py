"""Issue 11: output directories, one-line errors, parity, generate, device defaults, the run record, reproducibility.

The table of bad inputs runs through `hf_loops.cli.main` in ONE subprocess (`cli_cases_worker.py`: imports paid once,
stdout/stderr captured at the file-descriptor level, so logging and warnings count too); a few real `hf-loops`
processes prove the console behaviour (exit code, one stderr line, no traceback, SIGTERM clean-up)."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from helpers.cli_cases_worker import run_table
from helpers.common import umask as _umask
from helpers.conversion_helpers import chat_base, qwen3_dir, tiny_qwen3, write_official_tah2

from hf_loops.conversion import convert_qwen3, export
from hf_loops.conversion.export import TMP_PREFIX, atomic_output_dir, check_output_dir

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers and helpers
REPO = os.path.dirname(HERE)
OUTDIR = os.path.join(REPO, "hf_loops", "core", "outdir.py")
CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _qa(i):
    return {"question": f"What is {i} plus {i + 3}?", "answer": f"It is {2 * i + 3}."}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _tree(path):
    """{relative path: bytes} of every file under `path` (what is left on disk)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """Tiny checkpoints of every kind, and broken copies of them."""
    root = tmp_path_factory.mktemp("bad_inputs")
    base, tok = chat_base(root / "base", CHAT)
    q = tiny_qwen3(tie_word_embeddings=True)
    for arch, extra in (("tah2", {}), ("spiralformer", {"chunk_sizes": [2, 1], "num_pre_layers": 1, "num_loop_layers": 1, "num_post_layers": 0}), ("sgt", {})):
        export(convert_qwen3(q, arch, seed=0, **extra), root / arch, tokenizer=tok)
    for name in ("trunc", "garbage", "badcfg", "listcfg", "nan"):
        qwen3_dir(root / name, tie_word_embeddings=True)
    weights = root / "trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "garbage" / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    (root / "badcfg" / "config.json").write_text('{"model_type": "qwen3",\n  "hidden_size": 32,,\n}')
    (root / "listcfg" / "config.json").write_text("[1, 2]")
    nan = tiny_qwen3(tie_word_embeddings=True)
    with torch.no_grad():
        nan.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    nan.save_pretrained(root / "nan")
    from helpers.tah2_helpers import tiny_tah2

    official = write_official_tah2(root / "official", tiny_tah2())
    broken = write_official_tah2(root / "official_bad", tiny_tah2())
    with open(os.path.join(broken, "tah_config.json"), "a") as f:
        f.write("}")
    data = {
        "good": _write_jsonl(root / "good.jsonl", [_qa(i) for i in range(8)]),
        "no_answer": _write_jsonl(root / "no_answer.jsonl", [_qa(0), _qa(1), {"question": "And 2 plus 2?"}]),
        "text_null": _write_jsonl(root / "text_null.jsonl", [{"text": "hello"}, {"text": None}]),
        "malformed": _write_jsonl(root / "malformed.jsonl", [_qa(0), _qa(1), '{"question": "x", "answer": '] ),
        "not_object": _write_jsonl(root / "not_object.jsonl", [_qa(0), "[1, 2]"]),
        "long": _write_jsonl(root / "long.jsonl", [{"question": "a very long question " * 8, "answer": "yes"}] * 2),
    }
    (root / "empty.jsonl").write_text("\n")
    data["empty"] = str(root / "empty.jsonl")
    (root / "busy").mkdir()
    (root / "busy" / "keep.txt").write_text("mine")
    (root / "a_file").write_text("not a directory")
    (root / "empty_out").mkdir(mode=0o755)
    (root / "dot").mkdir()
    return {"root": root, "base": base, "data": data, "official": official, "broken": broken, "tok": tok}


def _cases(w):
    r, base, d = w["root"], w["base"], w["data"]

    def train(out, *extra, dataset="good"):
        return ["train", "--base", base, "--dataset", d[dataset], "--output-dir", str(r / out), *extra]

    def convert(src, out, *extra, arch="tah2"):
        return ["convert", str(src), "--arch", arch, "--out", str(r / out), *extra]

    def gen(model, *extra):
        return ["generate", str(r / model) if model != "base" else base, "--prompt", "ab", "--max-new-tokens", "2",
                *extra]

    # name: (argv, cwd, exit code, regex the last stderr line must match (None: success), check of what is left)
    return {
        # --- convert: output directories --------------------------------------------------------------------------
        "convert_out_is_a_file": (convert(base, "a_file"), r, 2, r"--out .*a_file.* is a file", "file_kept"),
        "convert_out_not_empty": (convert(base, "busy"), r, 2, r"not empty .*keep\.txt", "busy_kept"),
        "convert_out_unwritable": (convert(base, "x") [:-1] + ["/sys/hf_loops_out"], r, 2, r"cannot write in '/sys'",
                                   None),
        "convert_out_under_a_file": (convert(base, "a_file/sub"), r, 2, r"is a file", "file_kept"),
        "convert_out_empty_string": (convert(base, "x")[:-1] + [""], r, 2, r"--out is empty", None),
        "convert_out_dot": (convert(base, "x")[:-1] + ["."], r / "dot", 0, None, "dot_written"),
        "convert_out_existing_empty": (convert(base, "empty_out"), r, 0, None, "empty_out_written"),
        # --- convert: sources -------------------------------------------------------------------------------------
        "convert_truncated_safetensors": (convert(r / "trunc", "o1"), r, 2,
                                          r"trunc/model\.safetensors' is not a valid \.safetensors file", "no_o1"),
        "convert_garbage_safetensors": (convert(r / "garbage", "o2"), r, 2,
                                        r"garbage/model\.safetensors' is not a valid", "no_o2"),
        "convert_invalid_config_json": (convert(r / "badcfg", "o3"), r, 2,
                                        r"badcfg/config\.json:2: invalid JSON \(column", "no_o3"),
        "convert_config_json_not_object": (convert(r / "listcfg", "o4"), r, 2,
                                           r"listcfg/config\.json': expected a JSON object", "no_o4"),
        "convert_invalid_tah_config_json": (convert(w["broken"], "o5"), r, 2, r"tah_config\.json': invalid JSON",
                                            "no_o5"),
        "convert_missing_source": (convert(r / "nowhere", "o6"), r, 2, r"nowhere.* not a local directory", "no_o6"),
        "convert_tokenizer_nowhere": (convert(base, "o7", "--tokenizer", str(r / "no_tok")), r, 2,
                                      r"tokenizer .*no_tok.* not an existing directory", "no_o7"),
        "convert_tokenizer_is_a_file": (convert(base, "o8", "--tokenizer", str(r / "a_file")), r, 2,
                                        r"a_file' is a file", "no_o8"),
        "convert_push_offline": (convert(base, "o9", "--push-to-hub", "me/x"), r, 2,
                                 r"wrote .*o9, but could not push it to the Hub repo 'me/x' \(offline", "o9_written"),
        "convert_nan_weights": (convert(r / "nan", "o10"), r, 2, r"NaN/inf values.*--no-parity", "no_o10"),
        "convert_nan_weights_no_parity": (convert(r / "nan", "o11", "--no-parity"), r, 0, None, None),
        "convert_fine_to_coarse_chunks": (convert(base, "o12", "--set", "chunk_sizes=[1,2,4]", arch="spiralformer"),
                                          r, 2, r"SpiralFormerConfig\.chunk_sizes must run coarse → fine", "no_o12"),
        "convert_bad_set": (convert(base, "o13", "--set", "max_iterations"), r, 2, r"--set expects KEY=VALUE",
                            "no_o13"),
        "convert_official_no_missing_report": (convert(w["official"], "o14"), r, 0, None, "no_missing_report"),
        # --- generate ---------------------------------------------------------------------------------------------
        "generate_empty_prompt": (["generate", str(r / "tah2"), "--prompt", ""], r, 2, r"--prompt is empty", None),
        "generate_blank_prompt": (["generate", str(r / "tah2"), "--prompt", "   "], r, 2, r"--prompt is empty", None),
        "generate_max_iterations_0": (gen("tah2", "--max-iterations", "0"), r, 2,
                                      r"max_iterations must be an integer >= 1, got 0", None),
        "generate_exit_threshold_0": (gen("tah2", "--exit-threshold", "0"), r, 2,
                                      r"exit_threshold must be in the open interval \(0, 1\), got 0", None),
        "generate_exit_threshold_1_5": (gen("tah2", "--exit-threshold", "1.5"), r, 2, r"exit_threshold .* got 1\.5",
                                        None),
        "generate_knob_on_qwen3": (gen("base", "--max-iterations", "2"), r, 2, r"'qwen3' model has no max_iterations",
                                   None),
        "generate_tokenizer_nowhere": (gen("tah2", "--tokenizer", str(r / "no_tok")), r, 2,
                                       r"--tokenizer .*no_tok.* not an existing directory", None),
        "generate_truncated_safetensors": (gen("trunc"), r, 2, r"trunc/model\.safetensors' is not a valid", None),
        "generate_invalid_config_json": (gen("badcfg"), r, 2, r"badcfg/config\.json:2: invalid JSON \(column", None),
        "generate_tah2_with_depth": (gen("tah2", "--show-depth", "--max-iterations", "2", "--exit-threshold", "0.5"),
                                     r, 0, None, "depth_lines"),
        "generate_spiralformer": (gen("spiralformer", "--show-depth"), r, 0, None, None),
        "generate_sgt": (gen("sgt"), r, 0, None, None),
        "generate_plain_qwen3": (gen("base"), r, 0, None, None),
        # --- train ------------------------------------------------------------------------------------------------
        "train_row_without_answer": (train("t1", dataset="no_answer"), r, 2,
                                     r"no_answer\.jsonl:3: field 'answer' is missing or null; expected a string",
                                     "no_t1"),
        "train_text_null": (train("t2", dataset="text_null"), r, 2, r"text_null\.jsonl:2: field 'text' is missing or "
                            r"null", "no_t2"),
        "train_empty_dataset_file": (train("t3", dataset="empty"), r, 2, r"empty\.jsonl' is empty", "no_t3"),
        "train_malformed_jsonl_line": (train("t4", dataset="malformed"), r, 2, r"malformed\.jsonl:3: invalid JSON",
                                       "no_t4"),
        "train_row_not_an_object": (train("t5", dataset="not_object"), r, 2, r"not_object\.jsonl:2: expected a JSON "
                                    r"object", "no_t5"),
        "train_tokenizer_nowhere": (train("t6", "--tokenizer", str(r / "no_tok")), r, 2,
                                    r"--tokenizer .*no_tok.* not an existing directory", "no_t6"),
        "train_push_offline": (train("t7", "--push-to-hub", "me/x", "--max_steps", "1", "--save_strategy", "no"), r, 2,
                               r"could not push .*t7.* to the Hub repo 'me/x'", "t7_written"),
        "train_output_dir_not_empty": (train("busy"), r, 2, r"--output-dir .*busy.* is not empty .*"
                                       r"--overwrite-output-dir", "busy_kept"),
        "train_output_dir_is_a_file": (train("a_file"), r, 2, r"--output-dir .*a_file.* is a file", "file_kept"),
        "train_invalid_base_config": (train("t8")[:2] + [str(r / "badcfg")] + train("t8")[3:] +
                                      ["--tokenizer", base], r, 2, r"badcfg/config\.json:2: invalid JSON", "no_t8"),
        "train_truncated_base_weights": (train("t9")[:2] + [str(r / "trunc")] + train("t9")[3:] + ["--tokenizer", base],
                                         r, 2, r"trunc/model\.safetensors' is not a valid", "no_t9"),
        "train_every_prompt_too_long": (train("t10", "--max_length", "12", dataset="long"), r, 2,
                                        r"removed every completion token from all 2 train examples", None),
    }


@pytest.fixture(scope="module")
def results(w):
    if os.access("/sys", os.W_OK) and os.geteuid() != 0:
        pytest.skip("/sys is writable here")
    cases = _cases(w)
    before = {"file": (w["root"] / "a_file").read_bytes(), "busy": _tree(w["root"] / "busy")}
    return run_table(cases, w["root"], timeout=300), before


CASE_NAMES = [
    "convert_out_is_a_file", "convert_out_not_empty", "convert_out_unwritable", "convert_out_under_a_file",
    "convert_out_empty_string", "convert_out_dot", "convert_out_existing_empty", "convert_truncated_safetensors",
    "convert_garbage_safetensors", "convert_invalid_config_json", "convert_config_json_not_object",
    "convert_invalid_tah_config_json", "convert_missing_source", "convert_tokenizer_nowhere",
    "convert_tokenizer_is_a_file", "convert_push_offline", "convert_nan_weights", "convert_nan_weights_no_parity",
    "convert_fine_to_coarse_chunks", "convert_bad_set", "convert_official_no_missing_report",
    "generate_empty_prompt", "generate_blank_prompt", "generate_max_iterations_0", "generate_exit_threshold_0",
    "generate_exit_threshold_1_5", "generate_knob_on_qwen3", "generate_tokenizer_nowhere",
    "generate_truncated_safetensors", "generate_invalid_config_json", "generate_tah2_with_depth",
    "generate_spiralformer", "generate_sgt", "generate_plain_qwen3", "train_row_without_answer", "train_text_null",
    "train_empty_dataset_file", "train_malformed_jsonl_line", "train_row_not_an_object", "train_tokenizer_nowhere",
    "train_push_offline", "train_output_dir_not_empty", "train_output_dir_is_a_file", "train_invalid_base_config",
    "train_truncated_base_weights", "train_every_prompt_too_long",
]


def _check_disk(kind, w, before, result):
    r = w["root"]
    if kind is None:
        return
    if kind == "file_kept":
        assert (r / "a_file").read_bytes() == before["file"]
    elif kind == "busy_kept":
        assert _tree(r / "busy") == before["busy"]
    elif kind.startswith("no_"):
        assert not (r / kind[3:]).exists()
    elif kind in ("dot_written", "empty_out_written"):
        out = r / ("dot" if kind == "dot_written" else "empty_out")
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
        assert stat.S_IMODE(out.stat().st_mode) == 0o755  # kept, not rmdir-ed or made 0700
        assert not [p for p in os.listdir(out) if p.startswith(TMP_PREFIX)]
        mode = stat.S_IMODE((out / "model.safetensors").stat().st_mode)
        assert mode & 0o044, oct(mode)  # readable by others as usual, not 0600
    elif kind in ("o9_written", "t7_written"):  # the result is kept; only the upload failed
        assert (r / kind[:2] / "config.json").is_file()
    elif kind == "no_missing_report":
        both = result["stdout"] + result["stderr"]
        assert "newly initialized" not in both and "MISSING" not in both, both[-2000:]
        assert (r / "o14" / "config.json").is_file()
    elif kind == "depth_lines":
        rows = [line.split() for line in result["stdout"].splitlines() if line[:1].isdigit()]
        assert len(rows) == 2 and all(row[0] in {"1", "2"} for row in rows)
    else:
        raise AssertionError(kind)


def test_the_table_has_at_least_30_bad_inputs(w):
    cases = _cases(w)
    assert sorted(cases) == sorted(CASE_NAMES)
    assert sum(1 for case in cases.values() if case[2] == 2) >= 30


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.slow
def test_bad_input(results, w, name):
    got, before = results
    argv, cwd, rc, pattern, disk = _cases(w)[name]
    result = got[name]
    assert result["rc"] == rc, (result["rc"], result["stderr"][-2000:])
    assert "Traceback" not in result["stderr"], result["stderr"][-2000:]
    if pattern is not None:
        last = result["stderr"].strip().splitlines()[-1]
        assert last.startswith("error: ") and re.search(pattern, last), last
    _check_disk(disk, w, before, result)


# --- real processes: the console ------------------------------------------------------------------------------------

def _hf_loops(*argv, cwd, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "hf_loops.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def third_party_import_notice(line: str) -> bool:
    """Lines torchao 0.18 (the `quant` extra) writes when transformers imports it on a CPU machine, before any
    hf_loops code runs: one per CUDA-only kernel library it cannot load, and torch's pytree deprecation notice per
    enum it registers (docs/quantization.md). Everything else on stderr counts."""
    return ((line.startswith("Failed to load ") and "torchao" in line)
            or ("_pytree.py" in line and "register_constant()" in line))


@pytest.mark.slow
def test_console_bad_input_is_one_stderr_line_and_exit_code_2(w):
    res = _hf_loops("convert", w["base"], "--arch", "tah2", "--out", str(w["root"] / "a_file"), cwd=w["root"])
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip() and not third_party_import_notice(line)]
    assert len(lines) == 1 and lines[0].startswith("error: --out") and "is a file" in lines[0], res.stderr


def test_sigterm_during_export_removes_the_temporary_directory(tmp_path):
    script = tmp_path / "exporting.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, time
        # the stdlib-only module, loaded by path: no torch/transformers import in this process
        spec = importlib.util.spec_from_file_location("outdir", {OUTDIR!r})
        outdir = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(outdir)
        with outdir.atomic_output_dir({str(tmp_path / "out")!r}) as tmp:
            open(tmp + "/model.safetensors", "wb").write(b"x" * 1000)
            print(tmp, flush=True)
            time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    tmp = proc.stdout.readline().strip()
    assert os.path.isdir(tmp) and os.path.basename(tmp).startswith(TMP_PREFIX)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not os.path.exists(tmp) and not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(TMP_PREFIX)] == []


# --- in process -----------------------------------------------------------------------------------------------------

def test_sigkill_leftovers_are_named_and_removed_by_the_next_export(tmp_path, capsys):
    dead = tmp_path / f"{TMP_PREFIX}999999999_abc"  # a pid that does not run
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 100)
    alive = tmp_path / f"{TMP_PREFIX}{os.getppid()}_abc"  # a live process's export is left alone
    alive.mkdir()
    with atomic_output_dir(str(tmp_path / "out")) as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    assert not dead.exists() and alive.exists()
    assert f"removing '{dead}'" in capsys.readouterr().err
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~_umask()


def test_existing_empty_directory_is_never_rmdir_ed(tmp_path):
    """A mount point cannot be removed or renamed over (EBUSY): the files are moved into it instead."""
    out = tmp_path / "mnt"
    out.mkdir()
    real_replace, real_rmdir = os.replace, os.rmdir

    def busy(real):
        def call(path, *args, **kwargs):
            if os.path.abspath(args[0] if real is real_replace else path) == str(out):
                raise OSError(16, "Device or resource busy")
            return real(path, *args, **kwargs)
        return call

    with mock.patch("os.rmdir", side_effect=busy(real_rmdir)), mock.patch("os.replace", side_effect=busy(real_replace)):
        with atomic_output_dir(str(out)) as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")
            open(os.path.join(tmp, "model.safetensors"), "w").write("w")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]



def test_read_only_location_is_refused_before_any_work(tmp_path):
    with mock.patch("tempfile.mkdtemp", side_effect=OSError(30, "Read-only file system")):
        with pytest.raises(PermissionError, match=r"cannot write in .*Read-only file system"):
            check_output_dir(str(tmp_path / "out"), "--out")


def test_interrupted_move_never_shows_a_new_config_beside_old_weights(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "model.safetensors").write_text("old")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(os.path.basename(dst))
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after the first file
        return real_replace(src, dst)

    with mock.patch("os.replace", side_effect=replace), pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(str(out), merge=True) as tmp:
            for name in ("config.json", "model.safetensors", "tokenizer.json"):
                open(os.path.join(tmp, name), "w").write("new")
    assert not (out / "config.json").exists()  # no config: nothing loadable, never a mixed model
    assert calls[-1] != "config.json"
    with atomic_output_dir(str(out), merge=True) as tmp:
        for name in ("config.json", "model.safetensors"):
            open(os.path.join(tmp, name), "w").write("new")
    assert (out / "config.json").read_text() == (out / "model.safetensors").read_text() == "new"


def test_convert_qwen3_seed_gives_the_same_new_modules_and_keeps_the_global_rng(tmp_path):
    q = tiny_qwen3()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = convert_qwen3(q, "tah2", seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # fork_rng: the caller's RNG is untouched
    b = convert_qwen3(q, "tah2", seed=0)
    c = convert_qwen3(q, "tah2", seed=1)
    for (name, x), (_, y), (_, _z) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=False):
        assert torch.equal(x, y), name
    assert not torch.equal(a.decider.score.weight, c.decider.score.weight)
    path, _ = qwen3_dir(tmp_path / "q")
    d1, d2 = convert_qwen3(path, "tah2", seed=5), convert_qwen3(path, "tah2", seed=5)
    assert all(torch.equal(x, y) for x, y in zip(d1.state_dict().values(), d2.state_dict().values(), strict=False))


def test_spiralformer_chunk_sizes_must_run_coarse_to_fine():
    from hf_loops.modeling.configuration_spiralformer import SpiralFormerConfig

    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"SpiralFormerConfig\.chunk_sizes must run coarse → fine"):
        SpiralFormerConfig(chunk_sizes=[1, 2, 4], **kw)
    assert SpiralFormerConfig(chunk_sizes=[8, 4, 4, 1], **kw).chunk_sizes == [8, 4, 4, 1]


def test_generate_with_depths_api_errors():
    from hf_loops.inference import generate_with_depths

    model = convert_qwen3(tiny_qwen3(), "tah2", seed=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_with_depths(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_iterations must be an integer >= 1, got 0"):
        generate_with_depths(model, torch.tensor([[5, 6]]), max_iterations=0)
    with pytest.raises(ValueError, match="exit_threshold"):
        generate_with_depths(model, torch.tensor([[5, 6]]), exit_threshold=0)
    trace = generate_with_depths(tiny_qwen3(), torch.tensor([[5, 6]]), max_new_tokens=2)
    assert len(trace.tokens) == 2 and trace.depths is None


# --- train: the run directory ---------------------------------------------------------------------------------------

def _train_argv(w, out, *extra):
    return ["--base", w["base"], "--arch", "tah2", "--dataset", w["data"]["good"], "--output-dir", str(out),
            "--disable_tqdm", "true", *extra]


@pytest.mark.slow
def test_new_user_train_twice_is_bit_identical_and_a_third_run_refuses(w, tmp_path, capsys):
    """No recipe: CPU settings are picked (one line), two identical commands give identical weights, the run
    directory keeps its record, and a third run into the same directory refuses and changes nothing."""
    from hf_loops.training.train_tah2 import main as train_main

    a, b = tmp_path / "a", tmp_path / "b"
    assert train_main(_train_argv(w, a)) == 0
    err = capsys.readouterr().err
    assert "note: no CUDA device: training on CPU in float32 (use_cpu=True, bf16=False)" in err
    assert train_main(_train_argv(w, b)) == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    for name in ("trainer_state.json", "train_results.json", "run_config.json", "config.json"):
        assert (a / name).is_file(), name
    record = json.loads((a / "run_config.json").read_text())
    assert record["trainer"]["use_cpu"] is True and record["trainer"]["seed"] == 42
    assert record["model"]["max_iterations"] == 2 and record["script"]["dtype"] == "float32"
    assert json.loads((a / "trainer_state.json").read_text())["log_history"]
    assert "train_loss" in json.loads((a / "train_results.json").read_text())
    assert not [p for p in os.listdir(a) if p.startswith(TMP_PREFIX)]

    before = _tree(a)
    capsys.readouterr()
    assert train_main(_train_argv(w, a)) == 2
    assert "is not empty" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _tree(a) == before

    # --overwrite-output-dir clears it first: nothing of the old run is left (no old checkpoint-N)
    (a / "checkpoint-99").mkdir()
    assert train_main(_train_argv(w, a, "--overwrite-output-dir", "--save_strategy", "no")) == 0
    assert not (a / "checkpoint-99").exists() and not (a / "checkpoint-3").exists()
    for name in ("trainer_state.json", "train_results.json", "run_config.json"):  # kept without any checkpoint
        assert (a / name).is_file(), name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_device_defaults_and_dtype(w, monkeypatch, tmp_path):
    from hf_loops.training import train_tah2

    out = str(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = train_tah2.trainer_config({}, [], out, eval_dataset=False)
    assert cfg.use_cpu and not cfg.bf16
    assert train_tah2.device_defaults({"use_cpu": True}, []) == []  # the recipe decides
    assert train_tah2.device_defaults({}, ["--bf16", "false"]) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train_tah2.device_defaults({}, []) == ["--bf16", "true"]  # bf16 autocast over fp32 master weights
    # a bf16 checkpoint is loaded in fp32 by default, kept bf16 with --dtype bfloat16
    q = tiny_qwen3().to(torch.bfloat16)
    q.save_pretrained(tmp_path / "bf16")
    assert next(train_tah2.build_model(str(tmp_path / "bf16"), {}).parameters()).dtype == torch.float32
    pure = train_tah2.build_model(str(tmp_path / "bf16"), {}, "bfloat16")
    assert next(pure.parameters()).dtype == torch.bfloat16
