"""Shared pieces of the suite: model sizes, workloads, the run context, rows, interleaved timing, cache bytes."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_loops.conversion.qwen3_source import cast_model


@dataclass(frozen=True)
class Size:
    """A Qwen3-shaped configuration every architecture of a row is built from (random weights)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tie: bool = False


SIZES = {
    "tiny": Size("tiny", hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, ffn=384, vocab=2048),
    # ≥ 100M parameters (about 166M with the untied 32k head): compute, not Python overhead, dominates on a CPU.
    "100m": Size("100m", hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=64, ffn=3072, vocab=32000),
    # Qwen3-1.7B's shape (for the GPU run).
    "1.7b": Size("1.7b", hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936,
                 tie=True),
}


@dataclass(frozen=True)
class Workload:
    """Sequence lengths and repeat counts of one run (the same for every size of the run)."""

    prompt: int  # decode prompt length
    new: int  # decoded tokens
    train_seq: int  # training rows: tokens per sequence
    train_batch: int
    spiral_seq: int  # SpiralFormer-B vs LoopedFormer prefill length (the L = 2048)
    spiral_new: int  # SpiralFormer decode steps on the mixed-length batch
    repeats: int  # best of N (after one warm-up)
    compile_timeout: int  # seconds for one compiled-decode row (its own subprocess: build, compile, time)


WORKLOADS = {
    # CPU: the training rows use 2 × 128 tokens so that `all` (tiny + 100m) stays near 20 minutes on 2 cores.
    "full": Workload(prompt=128, new=32, train_seq=128, train_batch=2, spiral_seq=2048, spiral_new=32, repeats=3,
                     compile_timeout=360),
    "quick": Workload(prompt=24, new=6, train_seq=48, train_batch=2, spiral_seq=128, spiral_new=10, repeats=2,
                      compile_timeout=180),
    "cuda": Workload(prompt=128, new=32, train_seq=1024, train_batch=4, spiral_seq=2048, spiral_new=32, repeats=5,
                     compile_timeout=120),
}


@dataclass
class Ctx:
    """What every group needs: where and how to run, and which rows are wanted."""

    device: str
    dtype: torch.dtype
    workload: Workload
    attn: str = "auto"
    threads: int = 2
    quick: bool = False
    rows: tuple[str, ...] = ()  # row-id substrings to keep; "-x" drops ids containing x
    compile_sizes: tuple[str, ...] = ()  # sizes the compiled-decode rows run at (compilation takes minutes on a CPU)

    def wants(self, row_id: str) -> bool:
        """`--rows a,b,-c`: ids containing a or b (all when none is given), and not containing c."""
        keep = [r for r in self.rows if not r.startswith("-")]
        drop = [r[1:] for r in self.rows if r.startswith("-")]
        return (not keep or any(r in row_id for r in keep)) and not any(r in row_id for r in drop)

    def attn_impl(self) -> str:
        if self.attn != "auto":
            return self.attn
        if self.device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "sdpa"


@dataclass
class Row:
    id: str  # stable key, e.g. "tah2-eff-b1" (what --rows matches)
    name: str  # the issue table's wording
    size: str
    goal: str
    measured: float | None
    met: str  # "yes" | "no" | "reported" | "error"
    note: str = ""
    unit: str = "×"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def judged(ok: bool | None) -> str:
    return "reported" if ok is None else ("yes" if ok else "no")


def error_row(row_id: str, name: str, size: str, goal: str, exc: BaseException | str) -> Row:
    reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return Row(row_id, name, size, goal, None, "error", note=" ".join(str(reason).split())[:300])


# ----------------------------------------------------------------------------------------------------------------------
# timing


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = {"fn": time.perf_counter}


def set_clock(name: str) -> None:
    """"wall" (perf_counter) or "cpu" (this process's CPU time, all threads): on a CPU shared with other jobs, CPU time
    at one thread does not count the slices the scheduler gives to others, which wall time does."""
    if name not in _CLOCKS:
        raise ValueError(f"clock must be one of {sorted(_CLOCKS)}, got {name!r}")
    _clock["fn"] = _CLOCKS[name]


def clock_name() -> str:
    return next(name for name, fn in _CLOCKS.items() if fn is _clock["fn"])


def now() -> float:
    """The run's clock (see `set_clock`)."""
    return _clock["fn"]()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, the device synchronised on both sides."""
    sync(device)
    t0 = now()
    out = fn()
    sync(device)
    return now() - t0, out


def interleaved_best(fns: dict[str, Callable[[], tuple[float, Any]]], repeats: int,
                     warmups: dict[str, Callable[[], Any]] | None = None,
                     all_seconds: dict[str, list[float]] | None = None) -> dict[str, tuple[float, Any]]:
    """Best (seconds, payload) of each callable: one warm-up call each (`warmups[key]` when given, e.g. a short
    decode; else the callable itself), then `repeats` rounds that call every callable once in turn, so machine noise
    hits them alike. Each callable times itself (e.g. the decode loop without the prefill). `all_seconds`, when given,
    receives every repeat's seconds per key (the spread between repeats)."""
    for key, fn in fns.items():
        (warmups or {}).get(key, fn)()
    best: dict[str, tuple[float, Any]] = {}
    for _ in range(max(1, repeats)):
        for key, fn in fns.items():
            secs, payload = fn()
            if all_seconds is not None:
                all_seconds.setdefault(key, []).append(secs)
            if key not in best or secs < best[key][0]:
                best[key] = (secs, payload)
    return best


def spread(seconds: list[float]) -> float:
    """Slowest ÷ fastest repeat − 1 (0 for a single repeat)."""
    return max(seconds) / min(seconds) - 1.0 if seconds else 0.0


# ----------------------------------------------------------------------------------------------------------------------
# models


def qwen3_config(size: Size, **overrides) -> Qwen3Config:
    return Qwen3Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.ffn,
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, head_dim=size.head_dim, max_position_embeddings=8192,
                       tie_word_embeddings=size.tie, **overrides)


def qwen3_source(size: Size, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(qwen3_config(size)).eval()


def num_params(size: Size) -> int:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(size))
    return sum(p.numel() for p in model.parameters())


def built(ctx: Ctx, make: Callable[[], Any]) -> Any:
    """`make()` with new tensors created on the run's device (random init of a 1.7B model is slow on a CPU); where
    that fails, on the CPU (then `place` moves the model)."""
    if ctx.device == "cpu":
        return make()
    try:
        with torch.device(ctx.device):
            return make()
    except Exception:
        return make()


def place(model, ctx: Ctx) -> str:
    """Move `model` to the run's device/dtype (RoPE frequencies stay fp32, as `from_pretrained` leaves them) and pick
    its attention backend; returns the backend it runs."""
    model.to(ctx.device)
    if next(model.parameters()).dtype != ctx.dtype:
        cast_model(model, ctx.dtype)
    want = ctx.attn_impl()
    try:
        model.set_attn_implementation(want)
    except Exception as exc:  # a backend the model (or this machine) does not support: keep the default, say so
        return f"{model.config._attn_implementation} ({want} refused: {type(exc).__name__})"
    return str(model.config._attn_implementation)


def random_ids(vocab: int, batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


# ----------------------------------------------------------------------------------------------------------------------
# memory


def kv_bytes(cache) -> int:
    """Bytes of stored K/V: `cache.kv_bytes()` when the cache has it (TaH2Cache, metadata excluded), otherwise the
    keys + values of every cache layer, skipping TaH2's per-stream metadata slots (slot L of every L + 1)."""
    if hasattr(cache, "kv_bytes"):
        return int(cache.kv_bytes())
    per_stream = getattr(cache, "num_backbone_layers", 0)
    total = 0
    for i, layer in enumerate(cache.layers):
        if per_stream and i % (per_stream + 1) == per_stream:
            continue
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(t) and t.numel() > 0:
                total += t.numel() * t.element_size()
    return total
