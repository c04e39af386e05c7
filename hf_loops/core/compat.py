"""The transformers versions hf_loops supports, and the one place outside `modeling/` that knows what moved.

- `check_transformers()` (run first thing by `import hf_loops`): an installed transformers outside the declared range
  is an ImportError of one line; one inside it but newer than the newest tested version gets a one-line warning.
- The cache's name: 5.24 renamed `past_key_values` -> `cache` (forward keyword, `generate` keyword, output field).
  Code that calls transformers' own models or `generate`, or reads what they return, goes through `cache_kwargs` and
  `cache_of`. The modeling files (flat Hub remote code, they cannot import this module) keep their own shims in
  `hf_loops/modeling/loop_utils.py`; the detection is that file's `CACHE_RENAMED`.

This module imports nothing from transformers at import time: the version check must run before transformers' API is
touched (an older transformers can fail to import our modeling files with a less useful error).
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

# Declared in pyproject.toml (`dependencies`); tests/core/test_compat.py checks that the two agree.
TRANSFORMERS_SPEC = ">=5.19,<5.40"
# What the compatibility matrix (noxfile.py) runs; the README's "Tested versions" table lists the same.
TESTED_TRANSFORMERS = ("5.19.0", "5.22.2", "5.24.0", "5.25.0")


class UntestedTransformersWarning(UserWarning):
    """transformers is inside the declared range but newer than every version the matrix tests."""


def check_transformers(installed: str | None = None) -> str:
    """Raise ImportError (one line) when `installed` (default: the installed transformers) is outside
    `TRANSFORMERS_SPEC`; warn (one line) when it is newer than `TESTED_TRANSFORMERS[-1]`. Returns the version."""
    from packaging.specifiers import SpecifierSet  # a dependency of transformers (and of pip)
    from packaging.version import InvalidVersion, Version

    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:
            raise ImportError(f"hf_loops needs transformers{TRANSFORMERS_SPEC}; it is not installed") from None
    try:
        parsed = Version(installed)
    except InvalidVersion:
        raise ImportError(f"hf_loops needs transformers{TRANSFORMERS_SPEC}; cannot read the installed version "
                          f"{installed!r}") from None
    # Compare the release (5.25.0.dev0 counts as 5.25.0): a development build of a supported minor is supported.
    release = Version(parsed.base_version)
    if not SpecifierSet(TRANSFORMERS_SPEC).contains(release):
        raise ImportError(f"hf_loops needs transformers{TRANSFORMERS_SPEC}, found {installed}: "
                          f"pip install 'transformers{TRANSFORMERS_SPEC}'")
    newest = Version(TESTED_TRANSFORMERS[-1])
    if (release.major, release.minor) > (newest.major, newest.minor):
        warnings.warn(f"transformers {installed} is newer than the versions hf_loops is tested with "
                      f"({', '.join(TESTED_TRANSFORMERS)})", UntestedTransformersWarning, stacklevel=3)
    return installed


def cache_renamed() -> bool:
    """True on transformers >= 5.24, where the cache is `cache=` / `.cache` (before: `past_key_values`)."""
    from ..modeling.loop_utils import CACHE_RENAMED

    return CACHE_RENAMED


def cache_kwargs(cache) -> dict:
    """`{"cache": cache}` or `{"past_key_values": cache}`: the keyword transformers' own models and `generate` take
    on the installed version (ours take both)."""
    from ..modeling.loop_utils import HF_CACHE_KWARG

    return {HF_CACHE_KWARG: cache}


def cache_of(output):
    """The cache a model output or a `generate(..., return_dict_in_generate=True)` result carries (None when none)."""
    for name in ("cache", "past_key_values"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def activation_checkpointing_on(args) -> bool:
    """Whether training arguments ask for activation checkpointing: 5.24 names the field `activation_checkpointing`
    (`gradient_checkpointing` kept as its deprecated alias); before, only `gradient_checkpointing` exists."""
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None))


def enable_activation_checkpointing(model, kwargs: dict | None = None) -> None:
    """`model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)` (5.24's entry point), or
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)` where that is the only one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def serve_loads_models_in_their_own_process() -> bool:
    """True on transformers >= 5.25, whose `transformers serve` loads each model in a spawned process with a copy of
    its `ModelLoader` (and has no non-blocking mode); before, a `ModelManager` loaded it in the server's process."""
    from transformers.cli.serving import model_manager

    return hasattr(model_manager, "ModelLoader")
