"""Fetch transformers' own top-level test modules (`test_modeling_common.py`, `test_configuration_common.py`, ...)
for the installed transformers version into a cache outside the repository.

They are not in the wheel, only in the source distribution on the package registry. `make test` runs this script
before pytest; `tests/modeling/test_transformers_common.py` only reads the cache (no network) and skips with a reason
where it is absent. Nothing is written into the repository.

    python tests/fetch_transformers_tests.py           # no-op when the cache is complete
    HF_LOOPS_TRANSFORMERS_TESTS=/some/dir python tests/fetch_transformers_tests.py

Exit status 0 even when the download fails (one line on stderr): the test suite must still run offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ENV_VAR = "HF_LOOPS_TRANSFORMERS_TESTS"
MARKER = ".complete"  # written last: a half-extracted cache is never taken for a complete one
PACKAGE = "transformers_tests"  # the folder (and import name) the top-level tests/*.py land in


def transformers_version() -> str:
    from importlib.metadata import version  # the installed distribution's version, without importing it

    return version("transformers")


def cache_dir(version: str | None = None) -> Path:
    """`$HF_LOOPS_TRANSFORMERS_TESTS`, else `~/.cache/hf_loops/transformers-tests-<version>/`."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return Path.home() / ".cache" / "hf_loops" / f"transformers-tests-{version or transformers_version()}"


def is_complete(root: Path) -> bool:
    pkg = root / PACKAGE
    return (root / MARKER).is_file() and (pkg / "test_modeling_common.py").is_file() and (pkg / "__init__.py").is_file()


def _download_sdist(version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "--disable-pip-version-check", "-q", f"transformers=={version}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sdists = sorted(into.glob("transformers-*.tar.gz"))
    if not sdists:
        last = (done.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
        raise RuntimeError(f"pip download transformers=={version} failed: {last}")
    return sdists[0]


def _extract_top_level_tests(sdist: Path, dest: Path) -> int:
    """Copy `<sdist>/tests/*.py` (top level only: not tests/models/, tests/generation/) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                with tar.extractfile(member) as src, open(dest / parts[2], "wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
    return count


def fetch(version: str | None = None) -> Path:
    """Fill the cache once; returns its root (holding `transformers_tests/`). Raises RuntimeError on failure."""
    version = version or transformers_version()
    root = cache_dir(version)
    if is_complete(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    # Download and extract next to the cache, then move into place: a failure leaves no partial cache behind.
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        sdist = _download_sdist(version, tmp / "dl")
        staged = tmp / "root"
        if _extract_top_level_tests(sdist, staged / PACKAGE) == 0:
            raise RuntimeError(f"{sdist.name} holds no top-level tests/*.py")
        # `test_configuration_common.py` executes its folder's `__init__.py` (an empty file upstream, not in the sdist)
        (staged / PACKAGE / "__init__.py").touch()
        (staged / MARKER).write_text(f"transformers=={version}\n")
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    return root


def main() -> int:
    try:
        root = fetch()
    except Exception as exc:
        print(f"transformers' common tests unavailable ({exc}); tests/modeling/test_transformers_common.py will skip",
              file=sys.stderr)
        return 0
    print(f"transformers' common tests: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
