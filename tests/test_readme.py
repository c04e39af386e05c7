"""The README's Python code runs as written (in a fresh working directory, offline, on the embedded base)."""

import os
import re
import subprocess
import sys

import pytest
from helpers.common import REPO

README = os.path.join(REPO, "README.md")


def _python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_the_readme_has_a_python_example_on_its_first_screen():
    with open(README, encoding="utf-8") as f:
        head = f.read().split("\n")[:60]
    assert "```python" in head, "the README's first screen should show one runnable Python example"


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    blocks = _python_blocks()
    assert blocks
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    for i, code in enumerate(blocks):
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, f"README python block {i} failed:\n{code}\n--- stderr ---\n{res.stderr[-3000:]}"
    # the example exports a model and reloads it: the folder it names is complete
    assert os.path.isfile(tmp_path / "my-tah2" / "config.json")
    assert os.path.isfile(tmp_path / "my-tah2" / "README.md")


def test_the_readme_first_table_is_the_committed_demo_summary():
    """The README's first tables are `make demo`'s summary.json as committed in docs/demo_summary.json, row by row,
    and its claim lines are that summary's claim tests; the first table of the README is the depth-bound task's."""
    import json

    from hf_loops.demo.hop import claims, summary_markdown

    with open(os.path.join(REPO, "docs", "demo_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(README, encoding="utf-8") as f:
        text = f.read()
    tables = summary_markdown(summary)
    for line in tables.splitlines():
        assert line in text, f"README lacks the demo summary's row {line!r}"
    first_table = next(line for line in text.splitlines() if line.startswith("|"))
    assert first_table == tables.splitlines()[0]
    for name, ok, numbers in claims(summary["tasks"]["hop"]):
        assert f"**{'held' if ok else 'did not hold'}:** {name} ({numbers})" in text, name
