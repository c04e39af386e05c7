"""Issue 21's bad inputs and faults, through the CLI as a user meets them: exit code 2 and ONE line on stderr naming
the file, line, field or value; nothing half-written; earlier output intact. The table runs in ONE subprocess
(`cli_cases_worker.py`, imports paid once); a few Python-API cases run in process.

Where each case of the issue is tested ("case X" = `test_bad_input[X]` in this file; other files named):

BAD (a traceback, a silently wrong result, or lost data)
 1 checkpoint interrupted by SIGKILL while saving    tests/training/test_atomic_checkpoints.py::test_kill_during_a_save_
                                                     then_resume_gives_the_uninterrupted_weights
 2 ... by SIGTERM                                   tests/cli/test_faults.py::test_train_sigterm_during_a_checkpoint_
                                                     loses_only_that_checkpoint_and_resumes; test_atomic_checkpoints.py::
                                                     test_resume_true_skips_incomplete_checkpoints_and_names_them
 3 full disk during a checkpoint                     tests/cli/test_faults.py::test_train_full_disk_during_a_checkpoint_
                                                     loses_only_that_checkpoint
 4 two `train` runs into one new output directory    test_atomic_checkpoints.py::test_a_second_run_into_the_same_
                                                     directory_is_refused_while_the_first_runs
 5 train --learning_rate inf                         case train_learning_rate_inf
 6 pretrain --grad-clip -1                           case pretrain_grad_clip_negative
 7 model(ids, max_iterations=10**9)                  tests/modeling/test_ecosystem_paths.py::test_a_huge_max_iterations_
                                                     costs_what_the_reached_depth_costs
 8 eval --max-iterations 1000000000                  the same (eval passes the knob to that forward, validated by
                                                     test_eval_loop_knobs_are_refused_..._baseline below)
 9 analyze --recurrences 100000                      case analyze_recurrences_beyond_memory
10 analyze --fixed-point-recurrences 1e9             case analyze_fixed_point_beyond_memory
11 convert --tokenizer larger than the model         case convert_tokenizer_larger_than_model
12 eval on a checkpoint whose tokenizer is larger    case eval_tokenizer_larger_than_model
13 eval on a checkpoint missing decider weights      case eval_missing_decider_weights
14 generate / loading it                             case generate_missing_decider_weights;
                                                     test_from_pretrained_load_helper_names_every_missing_key (plain
                                                     `from_pretrained` keeps transformers' behaviour: a load report)
15 eval: "question": null                            case eval_question_null
16 eval --dataset a JSON list of ints                case eval_dataset_list_of_ints
17 eval: unwritable --out                            case eval_out_unwritable
18 eval: full disk                                   test_faults.py::test_eval_on_a_full_disk_keeps_nothing
19 evaluate(model, tok, examples=[])                 test_evaluate_refuses_no_examples_and_fractional_counts
20 analyze --max-length -5                           case analyze_max_length_negative
21 analyze --out . in an empty folder                case analyze_out_dot
22 demo --max-iterations 0                           case demo_max_iterations_0
23 demo --max-new-tokens 0                           case demo_max_new_tokens_0, demo_random_max_new_tokens_0
24 demo --random --max-iterations 0                  case demo_random_max_iterations_0
25 pretrain: unwritable --out, --tokenizer /nowhere, cases pretrain_out_unwritable, pretrain_tokenizer_nowhere;
   a full disk                                       test_faults.py::test_pretrain_on_a_full_disk_keeps_the_earlier_result

WEAK (refused, but unclearly or late)
 1 eval JSONL: non-UTF-8 bytes                       case eval_non_utf8_line
 2 eval JSONL: invalid JSON                          case eval_invalid_json_line
 3 train JSONL: non-UTF-8 bytes (read with           case train_non_utf8_line
   errors="replace" before)
 4 train JSONL: invalid JSON                         case train_invalid_json_line
 5 analyze .txt: non-UTF-8 bytes                     case analyze_non_utf8_text_file
 6 analyze .json: invalid JSON                       case analyze_invalid_json_file
 7 convert --calibration: non-UTF-8 bytes            case convert_calibration_non_utf8
 8 the reader's messages (file, line, column)        tests/core/test_core_plumbing.py::test_non_utf8_byte_is_named_with_
                                                     file_line_and_column, ::test_jsonl_errors_name_file_and_line
 9 --calibration DIR says "does not exist"           case convert_calibration_dir
10 train --dataset symlink loop blamed on the Hub    case train_dataset_symlink_loop
11 eval --dataset symlink loop                       case eval_dataset_symlink_loop
12 resuming a --arch standard run as tah2            test_atomic_checkpoints.py::test_resuming_a_standard_run_as_tah2_
                                                     names_the_settings
13 --num_train_epochs nan                            case train_num_train_epochs_nan
14 --gradient_accumulation_steps 0                   case train_gradient_accumulation_0
15 recipe with a !!python/object tag                 case train_recipe_python_tag
16 recipe with a YAML syntax error                   case train_recipe_yaml_syntax (and test_core_plumbing.py::
                                                     test_yaml_errors_are_user_errors)
17 messages with no assistant turn                   case train_messages_without_assistant
18 generate with a mismatched tokenizer              case generate_mismatched_tokenizer
19 analyze with a mismatched tokenizer               case analyze_mismatched_tokenizer
20 a prompt with a non-UTF-8 byte                    case generate_non_utf8_prompt
21 analyze --max-length 0                            case analyze_max_length_0
22 a prompt 5x over max_position_embeddings          case generate_prompt_over_positions
23 pretrain --vocab-size 5                           case pretrain_vocab_size_5
24 pretrain --max-positions 8 --seq-len 32           case pretrain_seq_len_over_positions
25 evaluate(max_new_tokens=2.5)                      test_evaluate_refuses_no_examples_and_fractional_counts
26 capture_trace on 0 tokens                         test_capture_trace_on_zero_tokens_names_the_shape
27 eval MISSING --baseline OK                        case eval_missing_checkpoint_before_baseline
28 demo --batch-size 0 refused after the trainings   case demo_batch_size_0 (refused before any work: "d3" absent)
29 new eval output folders with mode 0700            case eval_new_folder_modes
30 new analyze output folders with mode 0700         case analyze_new_folder_modes (files: case analyze_out_dot)
31 interrupted eval leaves .NAME.tmp-* folders       test_a_killed_run_s_staging_folder_is_removed_by_the_next_command_
                                                     and_named (eval, analyze and pretrain share core.outdir)
32 ... analyze                                       the same, and test_core_plumbing.py::test_stale_temporaries_of_
                                                     dead_processes_are_removed
33 ... pretrain                                      the same (pretrain_base writes through core.outdir.atomic_output_dir)
(The issue counts 36 WEAK cases; its bullets name the 33 above, some with variants it does not spell out.)

Also: `hf-loops serve` now answers through the one error boundary (core.errors.run_command): case
serve_folder_without_config; the boundary itself: test_core_plumbing.py::test_user_errors_exit_2_in_one_line_and_bugs_
exit_1; an explicit `eval --max-new-tokens 0`: case eval_max_new_tokens_0.
"""

import json
import os
import re
import shutil
import stat

import pytest
import torch
from helpers.cli_cases_worker import run_table
from helpers.common import umask
from helpers.conversion_helpers import CALIBRATION_TEXT, chat_base, tiny_qwen3, tiny_tokenizer
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from hf_loops.conversion import convert_qwen3, export
from hf_loops.core.outdir import TMP_PREFIX

CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _qa(i):
    return {"question": f"What is {i} plus {i + 3}?", "answer": f"It is {2 * i + 3}."}


def _big_tokenizer():
    """A word-level tokenizer with 200 ids: more than the tiny models' 97 embedding rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"w{i}": 4 + i for i in range(196)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs_core")
    base, tok = chat_base(root / "base", CHAT)
    export(convert_qwen3(tiny_qwen3(tie_word_embeddings=True), "tah2", seed=0), root / "tah2", tokenizer=tok)
    # the same checkpoint without its decider's weights
    export(convert_qwen3(tiny_qwen3(tie_word_embeddings=True), "tah2", seed=0), root / "no_decider", tokenizer=tok)
    weights = root / "no_decider" / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if not k.startswith("decider.")}, weights, metadata={"format": "pt"})
    _big_tokenizer().save_pretrained(root / "big_tok")
    # a checkpoint whose own tokenizer has more ids than its embedding rows (assembled by hand)
    shutil.copytree(root / "tah2", root / "tah2_big_tok")
    _big_tokenizer().save_pretrained(root / "tah2_big_tok")

    def write(name, text):
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(root / name)

    good = "".join(json.dumps(_qa(i)) + "\n" for i in range(8))
    data = {
        "good": write("good.jsonl", good),
        "null_question": write("null_question.jsonl", json.dumps(_qa(0)) + "\n" + json.dumps(
            {"question": None, "answer": "#### 1"}) + "\n"),
        "ints": write("ints.json", "[1, 2, 3]"),
        "latin1": write("latin1.jsonl", good.encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n'),
        "no_assistant": write("no_assistant.jsonl", "".join(json.dumps(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}) + "\n"
            for i in range(3)) + json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n"),
        "latin1_txt": write("latin1.txt", b"hello world\nbonjour \xe0 tous\n"),
        "evil_recipe": write("evil.yaml", "learning_rate: !!python/object/apply:os.system ['echo pwned']\n"),
        "broken_recipe": write("broken.yaml", "learning_rate: 1e-3\n  max_steps: [2\n"),
        "calib_latin1": write("calib.txt", b"text \xff more text"),
        "bad_json": write("bad_json.jsonl", good + '{"question": "q", "answer": \n'),
        "bad_json_texts": write("bad_texts.json", '["one text", "two texts",]'),
    }
    os.symlink(root / "loop.jsonl", root / "loop.jsonl")
    data["loop"] = str(root / "loop.jsonl")
    (root / "calib_dir").mkdir()
    (root / f"{TMP_PREFIX}999999999_dead").mkdir()  # the staging folder of a killed run (no such process)
    (root / "empty_here").mkdir()
    (root / "busy").mkdir()
    (root / "busy" / "keep.txt").write_text("mine")
    max_pos = json.loads((root / "tah2" / "config.json").read_text())["max_position_embeddings"]
    return {"root": root, "base": base, "data": data, "max_pos": max_pos}


def _cases(w):
    r, base, d = w["root"], w["base"], w["data"]
    tah2 = str(r / "tah2")

    def train(out, *extra, dataset="good"):
        return ["train", "--base", base, "--dataset", d[dataset], "--output-dir", str(r / out), *extra]

    def pretrain(out, *extra):
        return ["pretrain", "--out", str(r / out), "--steps", "1", "--no-progress", *extra]

    def ev(out, *extra, ckpt=tah2, dataset="good"):
        return ["eval", ckpt, "--dataset", d[dataset], "--out", str(r / out), "--no-progress",
                "--max-new-tokens", "2", *extra]

    def analyze(out, *extra):
        return ["analyze", tah2, "--text", "hello there world", "--out", str(r / out), "--no-progress", *extra]

    def demo(out, *extra):
        return ["demo", "--out", str(r / out), "--no-progress", *extra]

    def gen(*extra, prompt="ab"):
        return ["generate", tah2, "--prompt", prompt, "--max-new-tokens", "2", *extra]

    # name: (argv, cwd, exit code, regex of the last stderr line (None: success), a path that must not exist after)
    return {
        # --- train: the Trainer's own numbers, recipes, rows ------------------------------------------------------
        "train_learning_rate_inf": (train("t1", "--learning_rate", "inf"), r, 2,
                                    r"learning_rate must be a finite number >= 0, got inf", "t1"),
        "train_num_train_epochs_nan": (train("t2", "--num_train_epochs", "nan"), r, 2,
                                       r"num_train_epochs must be a finite number > 0, got nan", "t2"),
        "train_gradient_accumulation_0": (train("t3", "--gradient_accumulation_steps", "0"), r, 2,
                                          r"gradient_accumulation_steps must be an integer >= 1, got 0", "t3"),
        "train_recipe_python_tag": (train("t4", "--recipe", d["evil_recipe"]), r, 2,
                                    r"recipe .*evil\.yaml:1: not a plain YAML mapping \(could not determine a "
                                    r"constructor", "t4"),
        "train_recipe_yaml_syntax": (train("t5", "--recipe", d["broken_recipe"]), r, 2,
                                     r"recipe .*broken\.yaml:2: not a plain YAML mapping", "t5"),
        "train_non_utf8_line": (train("t6", dataset="latin1"), r, 2,
                                r"latin1\.jsonl:9: not UTF-8 text \(byte 0xe9", "t6"),
        "train_messages_without_assistant": (train("t7", dataset="no_assistant"), r, 2,
                                             r"no_assistant\.jsonl:4: field 'messages' has no assistant turn", "t7"),
        "train_dataset_symlink_loop": (train("t8", dataset="loop"), r, 2,
                                       r"loop\.jsonl' cannot be read: Too many levels of symbolic links", "t8"),
        "train_invalid_json_line": (train("t9", dataset="bad_json"), r, 2,
                                    r"bad_json\.jsonl:9: invalid JSON \(column \d+: Expecting value\)", "t9"),
        # --- pretrain: checked before any work ----------------------------------------------------------------------
        "pretrain_grad_clip_negative": (pretrain("p1", "--grad-clip", "-1"), r, 2, r"--grad-clip must be > 0, got -1",
                                        "p1"),
        "pretrain_lr_inf": (pretrain("p2", "--lr", "inf"), r, 2, r"--lr must be a finite number > 0, got inf", "p2"),
        "pretrain_vocab_size_5": (pretrain("p3", "--vocab-size", "5"), r, 2, r"--vocab-size must be >= 259", "p3"),
        "pretrain_seq_len_over_positions": (pretrain("p4", "--max-positions", "8", "--seq-len", "32"), r, 2,
                                            r"--seq-len \(32\) must be <= --max-positions \(8\)", "p4"),
        "pretrain_tokenizer_nowhere": (pretrain("p5", "--tokenizer", str(r / "nowhere")), r, 2,
                                       r"--tokenizer .*nowhere.* is not an existing directory", "p5"),
        "pretrain_out_unwritable": (pretrain("p6")[:1] + ["--out", "/sys/hf_loops_pretrain"] + pretrain("p6")[3:], r,
                                    2, r"cannot write in '/sys'", None),
        "pretrain_out_not_empty": (pretrain("busy"), r, 2, r"--out .*busy.* is not empty .*--overwrite", None),
        # --- convert ---------------------------------------------------------------------------------------------
        "convert_tokenizer_larger_than_model": (["convert", base, "--arch", "tah2", "--out", str(r / "c1"),
                                                 "--tokenizer", str(r / "big_tok")], r, 2,
                                                r"--tokenizer .*big_tok.* has 200 tokens but the model's vocabulary "
                                                r"has 97 rows", "c1"),
        "convert_calibration_dir": (["convert", base, "--arch", "sgt", "--out", str(r / "c2"), "--calibration",
                                     str(r / "calib_dir")], r, 2, r"--calibration file .*calib_dir.* is a directory",
                                    "c2"),
        "convert_calibration_non_utf8": (["convert", base, "--arch", "sgt", "--out", str(r / "c3"), "--calibration",
                                          d["calib_latin1"]], r, 2, r"calib\.txt:1: not UTF-8 text \(byte 0xff", "c3"),
        # --- eval ------------------------------------------------------------------------------------------------
        "eval_missing_decider_weights": (ev("e1", ckpt=str(r / "no_decider")), r, 2,
                                         r"no_decider.* lacks weights of its model: decider\.", "e1"),
        "eval_question_null": (ev("e2", dataset="null_question"), r, 2,
                               r"null_question\.jsonl:2: field 'question' is null; expected a string", "e2"),
        "eval_dataset_list_of_ints": (ev("e3", dataset="ints"), r, 2,
                                      r"ints\.json: item 1 of the JSON list is a JSON number", "e3"),
        "eval_out_unwritable": (ev("e4")[:4] + ["--out", "/sys/hf_loops_eval"] + ev("e4")[6:], r, 2,
                                r"cannot write in '/sys'", None),
        "eval_non_utf8_line": (ev("e5", dataset="latin1"), r, 2, r"latin1\.jsonl:9: not UTF-8 text", "e5"),
        "eval_dataset_symlink_loop": (ev("e6", dataset="loop"), r, 2,
                                      r"loop\.jsonl' cannot be read: Too many levels of symbolic links", "e6"),
        "eval_missing_checkpoint_before_baseline": (ev("e7", "--baseline", tah2, ckpt=str(r / "nowhere")), r, 2,
                                                    r"checkpoint .*nowhere.*: no such directory", "e7"),
        "eval_max_new_tokens_0": (ev("e8")[:-2] + ["--max-new-tokens", "0"], r, 2,
                                  r"--max-new-tokens must be an integer >= 1, got 0", "e8"),
        "eval_invalid_json_line": (ev("e9", dataset="bad_json"), r, 2,
                                   r"bad_json\.jsonl:9: invalid JSON \(column \d+: Expecting value\)", "e9"),
        "eval_tokenizer_larger_than_model": (ev("e10", ckpt=str(r / "tah2_big_tok")), r, 2,
                                             r"the tokenizer of .*tah2_big_tok.* has 200 tokens but the model's "
                                             r"vocabulary has 97 rows", "e10"),
        "eval_new_folder_modes": (ev("e_ok")[:-2] + ["--max-new-tokens", "1", "--no-decider-accuracy"], r, 0,
                                  None, None),
        # --- analyze ---------------------------------------------------------------------------------------------
        "analyze_max_length_negative": (analyze("a1", "--max-length", "-5"), r, 2,
                                        r"--max-length must be an integer >= 2, got -5", "a1"),
        "analyze_max_length_0": (analyze("a2", "--max-length", "0"), r, 2, r"--max-length must be an integer >= 2",
                                 "a2"),
        "analyze_recurrences_beyond_memory": (analyze("a3", "--recurrences", "1000000000", "--metrics", "residual"),
                                              r, 2, r"--recurrences 1000000000 needs about .* GiB .* at most \d+ fit",
                                              "a3"),
        "analyze_fixed_point_beyond_memory": (analyze("a4", "--fixed-point-recurrences", "1000000000", "--metrics",
                                                      "fixed_point"), r, 2,
                                              r"--fixed-point-recurrences 1000000000 needs about .* GiB", "a4"),
        "analyze_mismatched_tokenizer": (analyze("a5", "--tokenizer", str(r / "big_tok")), r, 2,
                                         r"--tokenizer .*big_tok.* has 200 tokens", "a5"),
        "analyze_non_utf8_text_file": (["analyze", tah2, "--dataset", d["latin1_txt"], "--out", str(r / "a6"),
                                        "--no-progress"], r, 2, r"latin1\.txt:2: not UTF-8 text", "a6"),
        "analyze_invalid_json_file": (["analyze", tah2, "--dataset", d["bad_json_texts"], "--out", str(r / "a7"),
                                       "--no-progress"], r, 2, r"bad_texts\.json:1: invalid JSON \(column 26", "a7"),
        "analyze_new_folder_modes": (analyze("a_ok", "--metrics", "residual", "--grouping", "none"), r, 0, None,
                                     None),
        "analyze_out_dot": (["analyze", tah2, "--text", "hello there world", "--out", ".", "--no-progress",
                             "--metrics", "residual", "--grouping", "none"], r / "empty_here", 0, None, None),
        # --- demo: an explicit 0 is refused, never replaced by a default; before any training ---------------------
        "demo_max_iterations_0": (demo("d1", "--task", "gsm8k", "--max-iterations", "0"), r, 2,
                                  r"--max-iterations must be an integer >= 2 for the TaH2 run, got 0", "d1"),
        "demo_max_new_tokens_0": (demo("d2", "--task", "gsm8k", "--max-new-tokens", "0"), r, 2,
                                  r"--max-new-tokens must be an integer >= 1, got 0", "d2"),
        "demo_batch_size_0": (demo("d3", "--batch-size", "0"), r, 2, r"--batch-size must be an integer >= 1, got 0",
                              "d3"),
        "demo_random_max_iterations_0": (["demo", "--random", "--max-iterations", "0"], r, 2,
                                         r"--max-iterations must be an integer >= 1, got 0", None),
        "demo_random_max_new_tokens_0": (["demo", "--random", "--max-new-tokens", "0"], r, 2,
                                         r"--max-new-tokens must be an integer >= 1, got 0", None),
        # --- generate --------------------------------------------------------------------------------------------
        "generate_prompt_over_positions": (gen(prompt="ab" * (5 * w["max_pos"] // 2)), r, 2,
                                           rf"exceed the model's max_position_embeddings \({w['max_pos']}\)", None),
        "generate_mismatched_tokenizer": (gen("--tokenizer", str(r / "big_tok")), r, 2,
                                          r"--tokenizer has 200 tokens but the model's vocabulary has 97 rows", None),
        "generate_non_utf8_prompt": (gen(prompt="ab\udcffc"), r, 2, r"--prompt holds a byte that is not UTF-8", None),
        # --- serve: the commands' one error boundary ---------------------------------------------------------------
        "serve_folder_without_config": (["serve", str(r / "calib_dir")], r, 2,
                                        r"(calib_dir.* has no config\.json|serving needs FastAPI)", None),
        "generate_missing_decider_weights": (["generate", str(r / "no_decider"), "--prompt", "ab"], r, 2,
                                             r"lacks weights of its model: decider\.", None),
    }


@pytest.fixture(scope="module")
def results(w):
    if os.access("/sys", os.W_OK) and os.geteuid() != 0:
        pytest.skip("/sys is writable here")
    before = {"busy": (w["root"] / "busy" / "keep.txt").read_text()}
    return run_table(_cases(w), w["root"]), before


CASE_NAMES = [
    "train_learning_rate_inf", "train_num_train_epochs_nan", "train_gradient_accumulation_0",
    "train_recipe_python_tag", "train_recipe_yaml_syntax", "train_non_utf8_line", "train_messages_without_assistant",
    "train_dataset_symlink_loop", "train_invalid_json_line",
    "pretrain_grad_clip_negative", "pretrain_lr_inf", "pretrain_vocab_size_5", "pretrain_seq_len_over_positions",
    "pretrain_tokenizer_nowhere", "pretrain_out_unwritable", "pretrain_out_not_empty",
    "convert_tokenizer_larger_than_model", "convert_calibration_dir", "convert_calibration_non_utf8",
    "eval_missing_decider_weights", "eval_question_null", "eval_dataset_list_of_ints", "eval_out_unwritable",
    "eval_non_utf8_line", "eval_dataset_symlink_loop", "eval_missing_checkpoint_before_baseline",
    "eval_max_new_tokens_0", "eval_invalid_json_line", "eval_tokenizer_larger_than_model", "eval_new_folder_modes",
    "analyze_invalid_json_file", "analyze_new_folder_modes", "analyze_max_length_negative", "analyze_max_length_0",
    "analyze_recurrences_beyond_memory", "analyze_fixed_point_beyond_memory", "analyze_mismatched_tokenizer",
    "analyze_non_utf8_text_file", "analyze_out_dot", "demo_max_iterations_0", "demo_max_new_tokens_0",
    "demo_batch_size_0", "demo_random_max_iterations_0", "demo_random_max_new_tokens_0",
    "generate_prompt_over_positions", "generate_mismatched_tokenizer", "generate_non_utf8_prompt",
    "generate_missing_decider_weights", "serve_folder_without_config",
]


def test_the_table_lists_every_case(w):
    assert sorted(_cases(w)) == sorted(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.slow
def test_bad_input(results, w, name):
    got, before = results
    argv, cwd, rc, pattern, absent = _cases(w)[name]
    result = got[name]
    assert result["rc"] == rc, (result["rc"], result["stderr"][-2000:])
    assert "Traceback" not in result["stderr"], result["stderr"][-2000:]
    if pattern is not None:
        lines = [line for line in result["stderr"].strip().splitlines() if line.strip()]
        assert lines[-1].startswith("error: ") and re.search(pattern, lines[-1]), lines[-1]
    if absent is not None:
        assert not (w["root"] / absent).exists()
    root = w["root"]
    # no temporary folder or lock file left (the table's own cases.json / results.json are not dot-files)
    assert not [n for n in os.listdir(root) if n.startswith((TMP_PREFIX, ".")) and n != ".cache"], os.listdir(root)
    assert (root / "busy" / "keep.txt").read_text() == before["busy"]  # earlier output intact
    if name in ("eval_new_folder_modes", "analyze_new_folder_modes"):  # a new result folder: the umask's modes
        out = root / ("e_ok" if name.startswith("eval") else "a_ok")
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask(), oct(out.stat().st_mode)
        assert any(f.is_file() for f in out.iterdir())
    if name == "analyze_out_dot":  # `.` is kept (not rmdir-ed) and filled, with the modes the umask gives
        here = root / "empty_here"
        assert {"metrics.json", "report.md"} <= set(os.listdir(here)), os.listdir(here)
        assert stat.S_IMODE((here / "metrics.json").stat().st_mode) == 0o666 & ~umask()


def test_a_killed_run_s_staging_folder_is_removed_by_the_next_command_and_named(results, w):
    got, _ = results
    assert not (w["root"] / f"{TMP_PREFIX}999999999_dead").exists()
    warned = [n for n, r in got.items() if f"{TMP_PREFIX}999999999_dead', the leftover" in r["stderr"]]
    assert warned, "no command named the leftover it removed"


# --- the Python API -------------------------------------------------------------------------------------------------

def test_evaluate_refuses_no_examples_and_fractional_counts():
    from hf_loops.evaluation.examples import EvalExample
    from hf_loops.evaluation.metrics import evaluate

    model, tok = tiny_qwen3(), tiny_tokenizer()
    tok.chat_template = CHAT
    with pytest.raises(ValueError, match="evaluate got no examples"):
        evaluate(model, tok, examples=[])
    ex = [EvalExample("what is 1", " #### 1", "#### 1")]
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 2\.5"):
        evaluate(model, tok, examples=ex, max_new_tokens=2.5)
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
        evaluate(model, tok, examples=ex, batch_size=0)


def test_capture_trace_on_zero_tokens_names_the_shape():
    from hf_loops.analysis.trace import capture_trace

    model = convert_qwen3(tiny_qwen3(), "tah2", seed=0)
    with pytest.raises(ValueError, match=r"at least one token, got shape \(1, 0\)"):
        capture_trace(model, torch.zeros(1, 0, dtype=torch.long))


def test_from_pretrained_load_helper_names_every_missing_key(w):
    from hf_loops.core.loading import load_causal_lm

    with pytest.raises(ValueError, match=r"lacks weights of its model: decider\.\w+"):
        load_causal_lm(str(w["root"] / "no_decider"))
    assert load_causal_lm(str(w["root"] / "tah2")).config.model_type == "tah2"


def test_sgt_calibration_text_still_reads(tmp_path):
    from hf_loops.conversion.sgt import calibration_ids

    path = tmp_path / "calib.txt"
    path.write_text(CALIBRATION_TEXT)
    assert sum(s.shape[1] for s in calibration_ids(str(path), tiny_tokenizer())) > 2


def test_eval_loop_knobs_are_refused_for_a_model_without_them_but_left_out_for_a_baseline(w, tmp_path, capsys):
    from hf_loops.evaluation.cli import main

    base, data = w["base"], w["data"]["good"]
    common = ["--dataset", data, "--split", "train[:1]", "--max-new-tokens", "1", "--no-progress",
              "--no-decider-accuracy", "--max-iterations", "2"]
    assert main([base, *common, "--out", str(tmp_path / "a")]) == 2
    assert "'qwen3' model has no max_iterations" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "a").exists()
    assert main([str(w["root"] / "tah2"), "--baseline", base, *common, "--out", str(tmp_path / "b")]) == 0
    assert "note: the 'qwen3' baseline has no max_iterations; evaluated as is" in capsys.readouterr().err
