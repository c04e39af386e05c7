"""tests/fetch_transformers_tests.py: the cache of transformers' top-level test modules (no network here: the
download is replaced by a hand-built sdist)."""

from __future__ import annotations

import io
import tarfile

import fetch_transformers_tests as fetch
import pytest


def _fake_sdist(path, version="9.9.9"):
    files = {
        f"transformers-{version}/tests/test_modeling_common.py": b"X = 1\n",
        f"transformers-{version}/tests/test_configuration_common.py": b"Y = 2\n",
        f"transformers-{version}/tests/models/qwen3/test_modeling_qwen3.py": b"nested\n",
        f"transformers-{version}/tests/generation/test_utils.py": b"nested\n",
        f"transformers-{version}/tests/fixtures/data.txt": b"not python\n",
        f"transformers-{version}/src/transformers/__init__.py": b"library\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(fetch.ENV_VAR, str(root))
    return root


def test_cache_dir_default_and_override(cache, monkeypatch):
    assert fetch.cache_dir("1.2.3") == cache
    monkeypatch.delenv(fetch.ENV_VAR)
    assert fetch.cache_dir("1.2.3").parts[-3:] == (".cache", "hf_loops", "transformers-tests-1.2.3")


def test_fetch_extracts_only_top_level_test_modules_then_is_a_no_op(cache, tmp_path, monkeypatch):
    calls = []

    def download(version, into):
        calls.append(version)
        into.mkdir(parents=True)
        return _fake_sdist(into / f"transformers-{version}.tar.gz", version)

    monkeypatch.setattr(fetch, "_download_sdist", download)
    root = fetch.fetch("9.9.9")
    assert root == cache and fetch.is_complete(root)
    pkg = root / fetch.PACKAGE
    assert sorted(p.name for p in pkg.iterdir()) == ["__init__.py", "test_configuration_common.py",
                                                     "test_modeling_common.py"]
    assert (pkg / "test_modeling_common.py").read_text() == "X = 1\n"
    assert fetch.fetch("9.9.9") == root
    assert calls == ["9.9.9"]  # the second call found the cache complete


def test_failed_download_prints_one_line_exits_0_and_leaves_nothing(cache, monkeypatch, capsys):
    def download(version, into):
        raise RuntimeError("pip download transformers==9.9.9 failed: no network")

    monkeypatch.setattr(fetch, "_download_sdist", download)
    monkeypatch.setattr(fetch, "transformers_version", lambda: "9.9.9")
    assert fetch.main() == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no network" in err and "will skip" in err
    assert not cache.exists()
    assert [p.name for p in cache.parent.iterdir()] == []  # no staging folder left behind
