"""The Hugging Face Hub side of conversion: resolving a source (local dir or Hub id) and pushing an export.

Network is used only when a Hub id is given (`snapshot_download`) or when pushing; tests mock both.
"""

from __future__ import annotations

import os

import huggingface_hub
from huggingface_hub import HfApi

# Files a conversion needs from a source repository (weights, configs, tokenizer, the official TaH2 extras).
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


def resolve_source_dir(source: str | os.PathLike, revision: str | None = None) -> str:
    """A local directory holding the checkpoint `source` names: the directory itself, or a Hub snapshot.

    A string that is not an existing directory is treated as a Hub repository id; offline or unreachable Hub (or an
    unknown repository) → `ValueError` saying so.
    """
    source = os.fspath(source)
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise ValueError(f"source {source!r} is a file; give a checkpoint directory or a Hub repository id")
    looks_local = source.startswith((".", "/", "~")) or os.sep in source.strip("/").replace("/", "", 1)
    try:
        huggingface_hub.utils.validate_repo_id(source)
    except Exception:
        looks_local = True
    if looks_local:
        raise ValueError(f"source {source!r} is not a local directory (and not a valid Hub repository id)")
    try:
        return huggingface_hub.snapshot_download(repo_id=source, revision=revision, allow_patterns=SOURCE_PATTERNS)
    except Exception as err:
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        raise ValueError(
            f"could not download {source!r} from the Hugging Face Hub"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ''}: the Hub is offline or unreachable, or the repository "
            f"does not exist ({type(err).__name__}: {err}). Give a local checkpoint directory instead."
        ) from err


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str | None = None, revision: str | None = None, ignore_patterns=None):
    """Upload the files of `folder` (minus `ignore_patterns`) to `repo_id` in ONE commit (the repository is created
    if needed)."""
    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=os.fspath(folder),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or "Upload converted looped model (hf_loops)",
        ignore_patterns=ignore_patterns,
    )
