"""Shared test set-up: offline Hub, one torch thread, the tiny Qwen3 config and model every test builds on."""

import collections
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny models: thread hand-off costs more than it saves; one thread also keeps float results reproducible.
torch.set_num_threads(1)

# Re-exported: `from conftest import ...` in tests written before tests/helpers/ keeps working.
from helpers.common import REPO, SHARED, tiny_qwen3, tiny_qwen3_config, umask  # noqa: E402,F401


@pytest.fixture
def shared_dir():
    if not os.path.isdir(SHARED):
        pytest.skip("../shared is not present")
    return SHARED


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """In a module with `QUICK_BY_NAME` (test method names), every other test is marked `slow`: transformers' common
    tests are methods of upstream mixins, which cannot take a decorator here."""
    for item in items:
        quick = getattr(getattr(item, "module", None), "QUICK_BY_NAME", None)
        if quick is not None and getattr(item, "originalname", item.name) not in quick:
            item.add_marker(pytest.mark.slow)


# Session summary of transformers' common model tests (tests/modeling/test_transformers_common.py): per
# architecture, how many common tests ran, passed, were skipped (by our table of looped-model refusals, or by the
# upstream test itself: no GPU, feature absent). Here, not in tests/modeling/conftest.py: test modules import
# `conftest` by name, and a second conftest module would shadow this one.
_MODULE = "test_transformers_common.py"
_COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def pytest_runtest_logreport(report):
    if f"{_MODULE}::" not in report.nodeid or hasattr(report, "context"):  # `context`: a subtest's report
        return
    case = report.nodeid.split("::")[1]
    counts = _COUNTS[case]
    if report.skipped and hasattr(report, "wasxfail"):
        counts["xfailed"] += 1
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        counts["skipped by name" if "skipped by name: " in reason else "skipped upstream"] += 1
    elif report.failed:
        counts["failed"] += 1
    elif report.when == "call" and report.passed:
        counts["passed"] += 1


def pytest_terminal_summary(terminalreporter):
    if not _COUNTS:
        return
    terminalreporter.section("transformers' common model tests per architecture")
    keys = ("passed", "skipped by name", "skipped upstream", "xfailed", "failed")
    for case, counts in sorted(_COUNTS.items()):
        run = sum(counts[k] for k in keys)
        terminalreporter.write_line(f"{case}: {run} collected, " + ", ".join(f"{counts[k]} {k}" for k in keys))
