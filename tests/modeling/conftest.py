"""Session summary of transformers' common model tests (tests/modeling/test_transformers_common.py): per
architecture, how many common tests ran, passed, were skipped (by our table of looped-model refusals, or by the
upstream test itself: no GPU, feature absent) and are known bugs (strict xfails)."""

from __future__ import annotations

import collections

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
