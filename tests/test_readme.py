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
