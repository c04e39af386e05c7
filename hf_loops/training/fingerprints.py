"""Cheaper `datasets` fingerprints for tokenizers.

`datasets` fingerprints every `map` call by pickling its function and arguments with its own dill pickler, in Python.
TRL's `SFTTrainer` passes the tokenizer to each of the maps that prepare a dataset, and a Qwen3 tokenizer holds its
151,669-entry vocabulary and 151,387 merges twice: as Python objects (`_vocab`, `_merges`, the inputs it was built
from) and inside the Rust backend (`_tokenizer`, which pickles as one string). Pickling the Python copies costs about
a second per map on a 2-core CPU, several seconds before every training run. The backend holds the same vocabulary and
merges, so leaving the Python copies out of the hash keeps the fingerprint a function of the tokenizer's content
(another vocabulary, merge list, added token or setting still gives another fingerprint) while the hash takes
milliseconds. Only hashing changes: the tokenizer itself, and the pickling `datasets` uses to send work to processes,
are untouched.
"""

from __future__ import annotations

# Python-side copies of what the backend tokenizer (`_tokenizer`) already holds.
DERIVED = ("_vocab", "_merges")
_REGISTERED: set[type] = set()


def register_tokenizer_fingerprint(tokenizer) -> bool:
    """Hash tokenizers of this type without their Python-side vocabulary copies (see the module docstring). Returns
    whether it applies: False for a tokenizer without a backend holding its vocabulary, or where `datasets` is absent
    or its pickler has changed."""
    if getattr(tokenizer, "_tokenizer", None) is None or not any(k in vars(tokenizer) for k in DERIVED):
        return False
    try:
        from datasets.utils._dill import Pickler
        from datasets.utils._dill import _save_transformersPreTrainedTokenizerBase as save_tokenizer
    except ImportError:
        return False
    kind = type(tokenizer)
    if kind not in _REGISTERED:

        def save_without_derived(pickler, obj):
            hidden = {k: obj.__dict__.pop(k) for k in DERIVED if k in obj.__dict__}
            try:
                save_tokenizer(pickler, obj)
            finally:
                obj.__dict__.update(hidden)

        Pickler.dispatch[kind] = save_without_derived
        _REGISTERED.add(kind)
    return True
