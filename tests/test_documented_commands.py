"""Every shell command of the README and docs/ is run by the suite or marked in the docs with the reason.

The commands are the lines of every fenced ```bash / ```sh / ```shell / ```zsh / ```console block of README.md and
docs/**/*.md (continuation lines and lines inside an open quote joined, whitespace collapsed, comments set apart);
every other fence must name its language (```python, ```text, ```yaml, ...), so a shell block cannot hide untagged.
docs/commands.toml lists each command once, with `run` (the test that runs it) or `marked` (why it cannot run here).
This module checks the list against the docs both ways, checks that a marked command says so in the docs and that a
`run` target exists, and runs the commands assigned to it: the documented text itself, in-process through
`hf_loops.cli.main` (what the `hf-loops` console script calls) or through bash (curl), offline, on tiny inputs: the
placeholders (QWEN3_DIR, OFFICIAL_TAH2_DIR, the port 8000, ...) replaced by paths built here, `[--option ...]`
kept with its first alternative, relative paths (out/..., demo_out/..., my_corpus.txt) made in a fresh directory."""

import ast
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from helpers.common import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
    import tomli as tomllib

HERE = "tests/test_documented_commands.py"
REGISTRY = os.path.join(REPO, "docs", "commands.toml")
SHELL = {"bash", "sh", "shell", "zsh", "console"}
# A command is marked in the docs when this phrase is in its attached text (see `Command.attached`).
MARK = re.compile(r"not run by (?:the|these) tests", re.I)


# ------------------------------------------------------------------------------------------------ the extractor
@dataclass
class Command:
    doc: str  # relative to the repository root
    line: int  # 1-based line of the command's first character
    text: str  # normalised: continuations joined, comments removed, whitespace collapsed
    trailing: list[str] = field(default_factory=list)  # comments on the command's own line(s)
    above: list[str] = field(default_factory=list)  # the comment lines directly above it (no blank line between)
    paragraph: str = ""  # the prose paragraph directly before its block

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def attached(self) -> str:
        """What the docs say next to the command: its trailing comments, the comment lines directly above it and the
        paragraph before its block, backticks dropped and whitespace collapsed."""
        return " ".join(" ".join([*self.above, *self.trailing, self.paragraph]).replace("`", "").split())


def doc_files() -> list[str]:
    files = ["README.md"]
    for root, _, names in os.walk(os.path.join(REPO, "docs")):
        files += [os.path.relpath(os.path.join(root, n), REPO) for n in names if n.endswith(".md")]
    return sorted(files)


def fenced_blocks(doc: str) -> list[tuple[str, int, str, str]]:
    """(language, line of the block's first body line, body, paragraph before it) of every fenced block of `doc`;
    an unclosed fence is an error."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.groups()
        para, j = [], i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        while j >= 0 and lines[j].strip() and not re.match(r"^\s*(`{3,}|~{3,})", lines[j]):  # not another block
            para.insert(0, lines[j])
            j -= 1
        end = next((k for k in range(i + 1, len(lines)) if lines[k].strip().startswith(fence)), None)
        assert end is not None, f"{doc}:{i + 1}: a fenced block that is never closed"
        blocks.append((lang.lower(), i + 2, "\n".join(lines[i + 1:end]) + "\n", " ".join(para)))
        i = end + 1
    return blocks


def split_commands(body: str, doc: str, first_line: int, paragraph: str) -> list[Command]:
    """The commands of one shell block: a command ends at a newline outside quotes not escaped by `\\`; `#` at the
    start of a word outside quotes starts a comment."""
    commands: list[Command] = []
    above: list[str] = []
    buf, start, trailing, quote = "", None, [], None
    line, i = first_line, 0
    line_had_comment = False
    while i < len(body):
        c = body[i]
        if quote:
            buf += c
            if c == quote:
                quote = None
            elif c == "\n":
                line += 1
        elif c == "\\" and body[i + 1:i + 2] == "\n":
            buf += " "
            i += 1
            line += 1
        elif c in "'\"":
            quote = c
            buf += c
        elif c == "#" and (not buf.strip() or buf[-1].isspace()):
            end = body.index("\n", i)
            (trailing if buf.strip() else above).append(body[i + 1:end].strip())
            line_had_comment = True
            i = end
            continue
        elif c == "\n":
            if buf.strip():
                commands.append(Command(doc, start, " ".join(buf.split()), trailing, above, paragraph))
                above = []
            elif not line_had_comment:
                above = []  # a blank line: the comments above it belong to no command
            buf, start, trailing, line_had_comment = "", None, [], False
            line += 1
        else:
            if start is None and not c.isspace():
                start = line
            buf += c
        i += 1
    assert quote is None and not buf.strip(), f"{doc}:{start}: a command with an unclosed quote or continuation"
    return commands


def documented_commands() -> list[Command]:
    found = []
    for doc in doc_files():
        for lang, first, body, para in fenced_blocks(doc):
            if lang in SHELL:
                found += split_commands(body, doc, first, para)
    return found


def registry() -> list[dict]:
    with open(REGISTRY, "rb") as f:
        return tomllib.load(f)["command"]


def entries_run_by(test_name: str) -> list[dict]:
    found = [e for e in registry() if e.get("run") == f"{HERE}::{test_name}"]
    assert found, f"docs/commands.toml assigns no command to {HERE}::{test_name}"
    return found


# ------------------------------------------------------------------------------------ the list against the docs
def test_every_fenced_block_names_its_language():
    untagged = [f"{doc}:{first - 1}" for doc in doc_files() for lang, first, _, _ in fenced_blocks(doc) if not lang]
    assert not untagged, ("fenced blocks without a language (```bash for commands, ```text for samples and trees), "
                          f"so no shell block can pass unchecked: {', '.join(untagged)}")


def test_the_extractor_joins_continuations_and_quotes_and_sets_comments_apart():
    body = ("# above\nrun a \\\n    --b 'x\n  y'   # trailing  \n\n# orphan\n\nnext 'a # b' c#d\n"
            "# output sample, no command below\n")
    cmds = split_commands(body, "x.md", 10, "para")
    assert [(c.line, c.text, c.trailing, c.above) for c in cmds] == [
        (11, "run a --b 'x y'", ["trailing"], ["above"]), (17, "next 'a # b' c#d", [], [])]


def listing_problems(documented: list[Command], entries: list[dict]) -> list[str]:
    """Each documented command has exactly one entry and each entry a documented command; one line per problem,
    naming file:line."""
    keys = [(e["doc"], e["command"]) for e in entries]
    problems = [f"docs/commands.toml lists this more than once: {doc}: {text}"
                for doc, text in sorted({k for k in keys if keys.count(k) > 1})]
    problems += [f"{c.where}: not listed in docs/commands.toml (add an entry with `run` or `marked`): {c.text}"
                 for c in documented if (c.doc, c.text) not in set(keys)]
    present = {(c.doc, c.text) for c in documented}
    problems += [f"docs/commands.toml lists a command no longer in {doc}: {text}" for doc, text in keys
                 if (doc, text) not in present]
    return problems


def marking_problems(documented: list[Command], entries: list[dict]) -> list[str]:
    """Each entry is `run` or `marked`; a marked command says "not run by the tests" and its reason next to it in the
    docs; a command the docs call not run is not listed as run."""
    by_key = {(c.doc, c.text): c for c in documented}
    problems = []
    for e in entries:
        c = by_key.get((e["doc"], e["command"]))
        if c is None:
            continue  # a listing problem
        if ("run" in e) == ("marked" in e):
            problems.append(f"{c.where}: the entry needs exactly one of `run` and `marked`")
        elif "marked" in e:
            reason = " ".join(e["marked"].replace("`", "").split())
            if not MARK.search(c.attached) or reason not in c.attached:
                problems.append(f"{c.where}: marked in docs/commands.toml ({e['marked']!r}) but the docs do not say "
                                f"'not run by the tests: {e['marked']}' next to it (a trailing comment, the comment "
                                "line above it or the paragraph before the block)")
        elif MARK.search(c.attached):
            problems.append(f"{c.where}: the docs say it is not run by the tests, docs/commands.toml says "
                            f"{e['run']} runs it")
    return problems


def test_every_documented_command_is_listed_and_every_listed_one_is_documented():
    documented = documented_commands()
    assert len(documented) >= 20, "the extractor finds too few commands: is it still reading the docs?"
    problems = listing_problems(documented, registry())
    assert not problems, "\n".join(problems)


def test_each_entry_is_run_or_marked_and_a_marked_one_says_why_in_the_docs():
    problems = marking_problems(documented_commands(), registry())
    assert not problems, "\n".join(problems)


def test_an_unlisted_command_a_stale_entry_and_an_unexplained_mark_fail():
    """The checks above on a made-up doc: a new ```bash line fails naming file:line, and so do the rest."""
    para = "Set up (not run by the tests: installs packages):"
    documented = split_commands("pip install x\nhf-loops new --flag  # brand new\n", "docs/new.md", 3, para)
    documented += split_commands("# DDP (not run by the tests: needs 8 GPUs):\ngo big\ngo small\n", "docs/b.md", 7, "")
    entries = [{"doc": "docs/new.md", "command": "pip install x", "marked": "installs packages"},
               {"doc": "docs/new.md", "command": "gone", "run": f"{HERE}::test_x"},
               {"doc": "docs/b.md", "command": "go big", "marked": "needs 9 GPUs"},
               {"doc": "docs/b.md", "command": "go small", "marked": "needs 8 GPUs"}]
    assert listing_problems(documented, entries) == [
        "docs/new.md:4: not listed in docs/commands.toml (add an entry with `run` or `marked`): hf-loops new --flag",
        "docs/commands.toml lists a command no longer in docs/new.md: gone"]
    problems = marking_problems(documented, entries)
    assert [p.split(":")[:2] for p in problems] == [["docs/b.md", "8"], ["docs/b.md", "9"]], problems
    assert "needs 9 GPUs" in problems[0] and "not run by the tests" in problems[1]
    entries[0] = {**entries[0], "run": f"{HERE}::test_x"}
    entries[0].pop("marked")
    assert "the docs say it is not run by the tests" in marking_problems(documented, entries)[0]


def _test_names(path: str) -> set[str]:
    """`test_x` and `Class::test_x` for every test function of the file at `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef))}
    return {n for n in names if n.split("::")[-1].startswith("test")}


def test_every_run_entry_names_a_test_that_exists():
    missing = []
    for e in registry():
        if "run" not in e:
            continue
        path, _, name = e["run"].partition("::")
        name = name.split("[")[0]  # a parametrized id runs the function
        full = os.path.join(REPO, path)
        if not name or not os.path.isfile(full) or name not in _test_names(full):
            missing.append(f"{e['doc']}: {e['command']}\n    -> {e['run']}")
    assert not missing, "docs/commands.toml names tests that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------------- running the documented text
def expand(command: str, placeholders: dict[str, str]) -> str:
    """The documented text made runnable: every `[--option ...]` kept, with the first of its `a|b|...` alternatives
    and N = 1; each placeholder (a whole word) replaced."""
    def optional(m):
        inner = re.sub(r"([^\s|]+)(?:\|[^\s|]+)+", r"\1", m.group(1))
        return re.sub(r"\bN\b", "1", inner)

    command = re.sub(r"\[(--[^\[\]]*)\]", optional, command)
    for key in sorted(placeholders, key=len, reverse=True):
        command = re.sub(rf"(?<![\w/.-]){re.escape(key)}(?![\w])", placeholders[key], command)
    return command


def test_expand_keeps_optional_flags_with_their_first_alternative_and_leaves_quoted_brackets():
    got = expand('tool X_DIR [--device auto|cpu] [--seed N] --split "train[:2]" [--flag]', {"X_DIR": "/p"})
    assert got == 'tool /p --device auto --seed 1 --split "train[:2]" --flag'


def run_hf_loops(command: str, cwd, capsys) -> str:
    """Run one `hf-loops ...` command line in-process (the console script's `main`) in `cwd`; its stdout."""
    from hf_loops.cli import main

    argv = shlex.split(command)
    assert argv[0] == "hf-loops", command
    old = os.getcwd()
    os.chdir(cwd)
    try:
        capsys.readouterr()
        rc = main(argv[1:])
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    assert rc == 0, f"`{command}` exited with {rc}:\n{err[-3000:]}"
    return out


def check_creates(entry: dict, cwd) -> None:
    missing = [p for p in entry.get("creates", []) if not os.path.exists(os.path.join(cwd, p))]
    assert not missing, f"`{entry['command']}` ({entry['doc']}) did not write {missing}"


@pytest.fixture(scope="module")
def base():
    from hf_loops.data import default_base_dir

    return default_base_dir()  # the embedded 3M-parameter, 4-layer Qwen3


def exported(base, arch, folder, **kw):
    """`base` converted to `arch` and exported with its tokenizer into `folder`."""
    from transformers import AutoTokenizer

    from hf_loops.conversion import convert_qwen3, export

    export(convert_qwen3(base, arch, **kw), folder, tokenizer=AutoTokenizer.from_pretrained(base), model_card=False)
    return str(folder)


class FakeHub:
    """`HfApi` recording what would be uploaded; no network."""

    calls: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=False, exist_ok=False, **kw):
        FakeHub.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, repo_id, folder_path, **kw):
        FakeHub.calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path))))
        return "commit-info"


@pytest.mark.slow
def test_conversion_commands_run_as_documented(tmp_path, base, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_loops.conversion import convert_qwen3, export_tah2

    official = export_tah2(convert_qwen3(base, "tah2"), tmp_path / "official", tokenizer=AutoTokenizer.from_pretrained(
        base))
    placeholders = {"QWEN3_DIR_OR_HUB_ID": base, "QWEN3_DIR": base, "OFFICIAL_TAH2_DIR": official}
    for i, entry in enumerate(entries_run_by("test_conversion_commands_run_as_documented")):
        cwd = tmp_path / f"c{i}"  # each its own directory: two commands write out/tah2
        cwd.mkdir()
        (cwd / "my_corpus.txt").write_text("Natalia sold 48 clips in April and half as many in May. " * 20)
        command = expand(entry["command"], placeholders)
        FakeHub.calls = []
        with mock.patch("hf_loops.conversion.hub.HfApi", FakeHub):
            out = run_hf_loops(command, cwd, capsys)
        check_creates(entry, cwd)
        assert "1-loop parity" in out and "wrote" in out, out
        folder = cwd / shlex.split(command)[shlex.split(command).index("--out") + 1]
        model = AutoModelForCausalLM.from_pretrained(folder)  # what a user does next
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()
        if "--push-to-hub" in command:  # one repository, one commit, with the files of the folder
            repo = shlex.split(command)[shlex.split(command).index("--push-to-hub") + 1]
            assert [c[:2] for c in FakeHub.calls] == [("create_repo", repo), ("upload_folder", repo)]
            assert FakeHub.calls[0][2] == ("--private" in command)
            assert {"config.json", "model.safetensors", "README.md"} <= set(FakeHub.calls[1][2])
        else:
            assert not FakeHub.calls


def _problems(path, n=3):
    rows = open(os.path.join(REPO, "hf_loops", "data", "gsm8k", "gsm8k_test_100.jsonl"), encoding="utf-8")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(next(rows) for _ in range(n))


@pytest.mark.slow
def test_evaluation_commands_run_as_documented(tmp_path, base, capsys):
    exported(base, "tah2", tmp_path / "demo_out" / "tah2", max_iterations=2)
    shutil.copytree(tmp_path / "demo_out" / "tah2", tmp_path / "demo_out" / "hop" / "tah2-seed0")  # make demo's
    shutil.copytree(base, tmp_path / "demo_out" / "standard")
    _problems(tmp_path / "demo_out" / "data" / "heldout.jsonl")
    exported(base, "spiralformer", tmp_path / "my-spiralformer", chunk_sizes=[2, 1])
    _problems(tmp_path / "problems.jsonl")
    for entry in entries_run_by("test_evaluation_commands_run_as_documented"):
        command = expand(entry["command"], {})
        out = run_hf_loops(command, tmp_path, capsys)
        check_creates(entry, tmp_path)
        argv = shlex.split(command)
        if "--json" in argv:  # --task depth|hop: one JSON object, the documented fields
            summary = json.loads(out)
            assert set(summary) == {"exact_match", "answer_nll", "mean_depth", "generated_depth",
                                    "decode_flops_ratio", "train_time_ratio", "by_difficulty"}, command
            levels = {"depth": ["copy", "1", "2", "3", "4", "5"], "hop": ["copy", "1", "2"]}  # --digits 4; 2 hops
            assert list(summary["by_difficulty"]) == levels[argv[argv.index("--task") + 1]]
            assert summary["by_difficulty"]["copy"]["tokens"] > 0 and summary["by_difficulty"]["1"]["tokens"] > 0
            assert summary["train_time_ratio"] is None and 0 <= summary["exact_match"] <= 1
            continue
        with open(tmp_path / argv[argv.index("--out") + 1] / "eval.json", encoding="utf-8") as f:
            results = json.load(f)["results"]
        assert len(results) == 1 + ("--baseline" in argv)  # one row per model
        assert all(r["metrics"]["examples"] == 3 for r in results)  # "train[:200]" of 3 rows: all 3
        pattern = argv[argv.index("--answer-pattern") + 1] if "--answer-pattern" in argv else "gsm8k"
        label = {"gsm8k": "exact match (#### N)", "last-number": "exact match (last number)"}[pattern]
        with open(tmp_path / argv[argv.index("--out") + 1] / "eval.md", encoding="utf-8") as f:
            assert label in f.read(), f"`{command}`: the table does not say what exact match compared"


@pytest.mark.slow
def test_training_command_runs_as_documented(tmp_path, capsys):
    os.symlink(os.path.join(REPO, "hf_loops"), tmp_path / "hf_loops")  # the documented paths are the repository's
    for entry in entries_run_by("test_training_command_runs_as_documented"):
        run_hf_loops(expand(entry["command"], {}), tmp_path, capsys)
        check_creates(entry, tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(command: str, cwd, capsys):
    """The documented `hf-loops serve` line run in-process; transformers' server is started non-blocking (the one
    change) so the test can send requests and stop it. Yields once /health answers (bounded wait)."""
    import hf_loops.serving.http as http

    servers, real = [], http.serve

    def non_blocking(args, non_blocking=False):
        servers.append(real(args, non_blocking=True))

    old = os.getcwd()
    os.chdir(cwd)  # for the server's life, as in its own process: it loads DIR (relative) at the first request
    try:
        with mock.patch.object(http, "serve", non_blocking):
            run_hf_loops(command, cwd, capsys)
        assert len(servers) == 1
        port = shlex.split(command)[shlex.split(command).index("--port") + 1]
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, f"`{command}` did not answer /health within 60 s"
                time.sleep(0.3)
        yield
    finally:
        if servers:
            servers[0].kill_server()
        os.chdir(old)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_serve_and_curl_commands_run_as_documented(tmp_path, base, capsys):
    pytest.importorskip("fastapi", reason="serving needs transformers' serving extras (pip install 'hf_loops[serve]')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # float32 (the base is bfloat16): `--dtype auto` serves it as stored, and greedy float32 tokens do not hang on
    # the reduction order of the server thread's kernels the way bfloat16 ties can
    exported(base, "tah2", tmp_path / "out" / "tah2", max_iterations=2, dtype=torch.float32)
    entries = entries_run_by("test_serve_and_curl_commands_run_as_documented")
    serve = [e for e in entries if e["command"].startswith("hf-loops serve")]
    curls = [e for e in entries if e["command"].startswith("curl")]
    assert len(serve) == 1 and curls and len(serve) + len(curls) == len(entries), entries
    placeholders = {"8000": str(_free_port())}
    with serving(expand(serve[0]["command"], placeholders), tmp_path, capsys):
        for entry in curls:
            command = expand(entry["command"], placeholders)
            res = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, f"`{command}` exited with {res.returncode}: {res.stderr[-2000:]}"
            answer = json.loads(res.stdout)
            body = json.loads(shlex.split(command)[shlex.split(command).index("-d") + 1])
            # greedy (temperature 0): the tokens of the model's own generate on the chat prompt
            folder = tmp_path / "out" / "tah2"
            tok = AutoTokenizer.from_pretrained(folder)
            device = "cuda" if torch.cuda.is_available() else "cpu"  # where `--device auto` puts the server's
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to(device).eval()  # --dtype auto
            assert model.dtype == torch.float32
            kwargs = json.loads(re.search(r"--chat-template-kwargs '([^']*)'", serve[0]["command"]).group(1))
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True, **kwargs).to(device)
            new = model.generate(**ids, max_new_tokens=body["max_tokens"], do_sample=False)[0, ids["input_ids"].shape[1]:]
            assert answer["choices"][0]["message"]["content"] == tok.decode(new, skip_special_tokens=True)
            assert answer["usage"]["completion_tokens"] == len(new)


@pytest.mark.slow
def test_reproduce_command_runs_as_documented(tmp_path, capsys):
    for entry in entries_run_by("test_reproduce_command_runs_as_documented"):
        out = run_hf_loops(expand(entry["command"], {}), tmp_path, capsys)
        check_creates(entry, tmp_path)
        assert "the paper's claims, tested:" in out
