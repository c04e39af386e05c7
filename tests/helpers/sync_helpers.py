"""Counting Python-visible host–device syncs (item, tolist, bool(), int(), nonzero, boolean indexing, ...)."""

import traceback

import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                "__getitem__")


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def spy_syncs(monkeypatch, record, only_from: str | None = None) -> None:
    """Patch torch.Tensor so that every sync calls `record(method name)`; with `only_from`, only syncs made directly by
    code whose file path contains that text (e.g. "hf_loops": HF's own mask builder is not counted).
    `monkeypatch.undo()` removes the spies."""

    def spy(name, original):
        def wrapper(self, *args, **kwargs):
            if name != "__getitem__" or _bool_index(args[0]):
                if only_from is None or only_from in traceback.extract_stack(limit=2)[0].filename:
                    record(name)
            return original(self, *args, **kwargs)
        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
