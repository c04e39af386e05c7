"""The supported transformers range: the import guard, its agreement with pyproject.toml, and the cache-name helpers
that let the same code run on 5.19-5.23 (`past_key_values`) and 5.24+ (`cache`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_loops.core import compat
from hf_loops.modeling import loop_utils

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject_spec(name: str) -> str:
    text = open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8").read()
    found = re.findall(rf'"{name}([<>=!~][^";]*)"', text)
    assert len(found) == 1, found
    return found[0]


def test_the_declared_range_is_the_one_pyproject_declares():
    assert compat.TRANSFORMERS_SPEC == _pyproject_spec("transformers")


def test_tested_versions_are_inside_the_range_and_sorted():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    versions = [Version(v) for v in compat.TESTED_TRANSFORMERS]
    assert versions == sorted(versions)
    assert all(SpecifierSet(compat.TRANSFORMERS_SPEC).contains(v) for v in versions)


def test_the_main_environment_pins_the_newest_tested_versions():
    """`make test` installs the Makefile's PINS: transformers is the newest tested version; the matrix (noxfile.py)
    runs the older ones, and its newest row pins the same TRL / PEFT / accelerate."""
    sys.path.insert(0, REPO)
    try:
        import noxfile
    finally:
        sys.path.remove(REPO)
    text = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    pins = dict(pin.split("==") for pin in re.search(r"^PINS \?= (.*)$", text, re.M).group(1).split())
    assert pins["transformers"] == compat.TESTED_TRANSFORMERS[-1]
    matrix = [row["transformers"] for row in noxfile.MATRIX.values()]
    assert sorted(matrix + [pins["transformers"]], key=lambda v: tuple(map(int, v.split(".")))) == list(
        compat.TESTED_TRANSFORMERS)
    newest = noxfile.MATRIX[max(noxfile.MATRIX, key=lambda v: tuple(map(int, v.split("."))))]
    assert {name: newest[name] for name in ("trl", "peft", "accelerate")} == {
        name: pins[name] for name in ("trl", "peft", "accelerate")}


@pytest.mark.parametrize("installed", ["5.18.0", "4.57.6", "5.40.0", "6.0.0", "5.40.0.dev0"])
def test_outside_the_range_is_one_clear_line(installed):
    with pytest.raises(ImportError) as info:
        compat.check_transformers(installed)
    message = str(info.value)
    assert "\n" not in message
    assert installed in message and compat.TRANSFORMERS_SPEC in message


@pytest.mark.parametrize("installed", ["5.19.0", "5.20.2", "5.22.2", "5.24.0", "5.24.1", "5.25.0", "5.25.0.dev0"])
def test_a_tested_minor_is_silent(installed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_transformers(installed) == installed


@pytest.mark.parametrize("installed", ["5.26.0", "5.39.9", "5.26.0.dev0"])
def test_newer_than_tested_warns_in_one_line_naming_the_tested_versions(installed):
    with pytest.warns(compat.UntestedTransformersWarning) as record:
        compat.check_transformers(installed)
    assert len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message and installed in message
    assert all(v in message for v in compat.TESTED_TRANSFORMERS)


def test_import_hf_loops_refuses_an_unsupported_transformers_in_one_line():
    """A real `import hf_loops` in a fresh interpreter whose transformers reports 5.18.0 (metadata patched)."""
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda name: '5.18.0' if name == 'transformers' else real(name)\n"
            "import hf_loops\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: hf_loops needs transformers{compat.TRANSFORMERS_SPEC}, found 5.18.0: "
                    f"pip install 'transformers{compat.TRANSFORMERS_SPEC}'")


def test_import_hf_loops_warns_above_the_newest_tested():
    code = ("import importlib.metadata as m, warnings\n"
            "real = m.version\n"
            "m.version = lambda name: '5.30.0' if name == 'transformers' else real(name)\n"
            "warnings.simplefilter('default')\n"
            "import hf_loops\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "UntestedTransformersWarning" in line]
    assert len(lines) == 1 and "5.30.0" in lines[0] and compat.TESTED_TRANSFORMERS[-1] in lines[0]


def test_the_cache_keyword_is_the_installed_versions():
    from packaging.version import Version
    from transformers import __version__

    renamed = Version(Version(__version__).base_version) >= Version("5.24")
    assert loop_utils.CACHE_RENAMED is renamed is compat.cache_renamed()
    assert compat.cache_kwargs(1) == ({"cache": 1} if renamed else {"past_key_values": 1})


def test_cache_helpers_drive_transformers_own_qwen3():
    """`cache_kwargs` / `cache_of` decode with transformers' own model on every version (a wrong keyword is silently
    ignored before 5.24: the decode would see one token and differ from the full forward)."""
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        full = qwen(ids).logits[:, -1]
        pre = qwen(ids[:, :6], use_cache=True)
        step = qwen(ids[:, 6:], use_cache=True, **compat.cache_kwargs(compat.cache_of(pre)))
    assert compat.cache_of(step).get_seq_length() == 7
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-4, atol=1e-5)


def test_our_outputs_carry_the_cache_under_the_installed_versions_name():
    out = loop_utils.CausalLMOutputWithPast(logits=torch.zeros(1), cache="c")
    assert out.cache == "c"
    assert list(out.keys()) == ["logits", "cache" if loop_utils.CACHE_RENAMED else "past_key_values"]
    assert isinstance(out, __import__("transformers").modeling_outputs.CausalLMOutputWithPast)
