"""Shared test set-up: offline Hub, one torch thread, the tiny Qwen3 config and model every test builds on."""

import collections
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny models: thread hand-off costs more than it saves; one thread also keeps float results reproducible.
torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3(seed=0, **overrides):
    """A tiny random `Qwen3ForCausalLM` (eval mode) from `tiny_qwen3_config`, seeded: the one tiny-model builder."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).eval()


@pytest.fixture
def shared_dir():
    if not os.path.isdir(SHARED):
        pytest.skip("../shared is not present")
    return SHARED


def umask() -> int:
    """The process's umask (read by setting it and putting it back): the modes new files and folders get."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
