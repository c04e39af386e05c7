"""SpiralFormer rows: SpiralFormer-B prefill ÷ LoopedFormer, and core passes per decode token on a mixed-length batch.

Both models split the same physical layers (pre = post = L/4, core = the rest); LoopedFormer is chunk sizes {1, 1},
SpiralFormer-B {8, 4, 2, 1}, and every parameter the two share is copied from SpiralFormer-B. Core passes are counted
by a hook on the first core layer: the number of token rows it runs on during the decode calls of `generate` (the
prefill call is not counted), divided by rows × decode calls. A fully row-selective decoder reaches Σ_t 1/g_t = 1.875;
one that runs every row whenever any row triggers needs up to 4 on a batch whose lengths differ mod 8.
"""

from __future__ import annotations

import torch

from hf_loops import SpiralFormerConfig
from hf_loops.modeling.modeling_spiralformer import SpiralFormerForCausalLM

from .common import Ctx, Row, Size, built, error_row, interleaved_best, judged, place, qwen3_config, random_ids, timed

SPIRAL_B, LOOPED = [8, 4, 2, 1], [1, 1]


def build(size: Size, ctx: Ctx, chunk_sizes: list[int], seed: int = 0) -> SpiralFormerForCausalLM:
    n = size.layers
    counts = dict(num_pre_layers=n // 4, num_loop_layers=n - 2 * (n // 4), num_post_layers=n // 4)
    base = {k: v for k, v in qwen3_config(size).to_dict().items() if k != "num_hidden_layers"}
    config = SpiralFormerConfig(**base, **counts, chunk_sizes=chunk_sizes)
    torch.manual_seed(seed)
    return built(ctx, lambda: SpiralFormerForCausalLM(config)).eval()


def share_weights(src, dst) -> None:
    """Copy every parameter `dst` has under the same name and shape (the layers, embeddings, head)."""
    theirs = src.state_dict()
    mine = dst.state_dict()
    dst.load_state_dict({k: theirs[k] if k in theirs and theirs[k].shape == v.shape else v for k, v in mine.items()})


def prefill_row(size: Size, ctx: Ctx, spiral) -> Row:
    looped = build(size, ctx, LOOPED)
    share_weights(spiral, looped)
    attn = place(looped, ctx)
    ids = random_ids(size.vocab, 1, ctx.workload.spiral_seq, ctx.device)

    def prefill(model):
        def run():
            with torch.no_grad():
                model(ids, use_cache=False, logits_to_keep=1)
        return lambda: timed(ctx.device, run)

    best = interleaved_best({"spiral_b": prefill(spiral), "looped": prefill(looped)}, ctx.workload.repeats)
    r = best["spiral_b"][0] / best["looped"][0]
    return Row("spiral-prefill", "SpiralFormer-B prefill ÷ LoopedFormer (same layers)", size.name, "≤ 0.95×", r,
               judged(r <= 0.95), note=f"L = {ctx.workload.spiral_seq}, batch 1; {attn}",
               extra={"seconds": {k: v[0] for k, v in best.items()}})


class CorePassCounter:
    """Counts the token rows the first core layer runs on, during decode calls only (call 1 is the prefill)."""

    def __init__(self, model):
        self.calls = 0
        self.core_rows = 0
        core = model.model.core_layers[0]
        self.handles = [model.register_forward_pre_hook(self._on_call),
                        core.register_forward_pre_hook(self._on_core, with_kwargs=True)]

    def _on_call(self, module, args):
        self.calls += 1

    def _on_core(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.calls > 1:
            self.core_rows += hidden.shape[:-1].numel()  # (rows, 1) dense or (1, n) packed: one per token row

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def core_passes_row(size: Size, ctx: Ctx, spiral, batch: int = 8) -> Row:
    prompt, new = ctx.workload.prompt, ctx.workload.spiral_new
    lengths = [prompt - 3 * i for i in range(batch)]  # 3·i mod 8 covers every residue: triggers never line up
    ids = random_ids(size.vocab, batch, prompt, ctx.device, seed=2)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths):  # left padding
        ids[i, : prompt - n] = 0
        mask[i, : prompt - n] = 0
    counter = CorePassCounter(spiral)
    try:
        with torch.no_grad():
            spiral.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0)
    finally:
        counter.remove()
    steps = counter.calls - 1
    r = counter.core_rows / (batch * max(steps, 1))
    ideal = sum(1 / g for g in SPIRAL_B)
    return Row("spiral-core-passes", "SpiralFormer decode: core passes per decode token, mixed-length batch",
               size.name, "≤ 1.9", r, judged(r <= 1.9), unit="",
               note=f"batch {batch}, lengths {min(lengths)}–{max(lengths)} left-padded, {steps} decode steps; "
                    f"row-selective ideal {ideal:.3f}",
               extra={"core_rows": counter.core_rows, "decode_calls": steps, "lengths": lengths})


def rows(size: Size, ctx: Ctx) -> list[Row]:
    wanted = [i for i in ("spiral-prefill", "spiral-core-passes") if ctx.wants(i)]
    if not wanted:
        return []
    try:
        spiral = build(size, ctx, SPIRAL_B)
        place(spiral, ctx)
    except Exception as exc:
        return [error_row(i, "SpiralFormer", size.name, "", exc) for i in wanted]
    out = []
    for row_id, fn in (("spiral-prefill", prefill_row), ("spiral-core-passes", core_passes_row)):
        if row_id in wanted:
            try:
                out.append(fn(size, ctx, spiral))
            except Exception as exc:
                out.append(error_row(row_id, "SpiralFormer", size.name, "", exc))
    return out
