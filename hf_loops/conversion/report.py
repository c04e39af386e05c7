"""What a conversion changed: parameter counts and the 1-loop parity with the source.

"1-loop parity" = the converted model with its loop switched off gives the source's logits:
- TaH2: `max_iterations=1` in the forward call (the Standard one-pass baseline);
- SpiralFormer: the same weights with `chunk_sizes=[1]` (one core pass), `core_output="delta"` and identity MeSH
  routers — defined only when every source layer is kept in order (otherwise the model is a different depth);
- SGT: every loop depth temporarily set to 0 (an empty plan).
"""

from __future__ import annotations

import torch

PARITY_PROMPTS = (
    "Looped transformers think harder on hard tokens.",
    "The capital of France is",
    "def fibonacci(n):",
)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def parity_inputs(vocab_size: int, tokenizer=None, prompts=PARITY_PROMPTS, seq_len: int = 12) -> list[torch.Tensor]:
    if tokenizer is not None:
        out = []
        for text in prompts:
            ids = [i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if i < vocab_size]
            if ids:
                out.append(torch.tensor([ids]))
        if out:
            return out
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, seq_len + 3 * k), generator=g) for k in range(len(prompts))]


@torch.no_grad()
def _one_loop_logits(model, ids: torch.Tensor, source_num_layers: int):
    """Logits of `model` with the loop switched off, or (None, reason): the architecture's registry entry knows how."""
    from .registry import ARCHITECTURES

    spec = ARCHITECTURES.get(model.config.model_type)
    if spec is None:
        return None, f"no 1-loop form known for model_type {model.config.model_type!r}"
    return spec.one_loop_logits(model, ids, source_num_layers)


def _spec_of(model):
    from .registry import ARCHITECTURES

    return ARCHITECTURES.get(model.config.model_type)


def _check_finite(logits: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise ValueError(
            f"the converted model's {what} contain {bad} NaN/inf values: the source weights hold NaN or inf (or "
            "overflow in this dtype); expected finite logits (pass --no-parity to export without this check)"
        )


@torch.no_grad()
def conversion_report(source, model, tokenizer=None, source_name: str | None = None) -> dict:
    """Parameter counts (source, new, added) and the 1-loop parity max-abs-diff on a few prompts.

    NaN or inf in the converted model's parity logits → `ValueError` (a parity of "nan" is not a result)."""
    src_params, params = count_parameters(source), count_parameters(model)
    report = {"source": source_name, "source_params": src_params, "params": params,
              "added_params": params - src_params, "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    device = next(model.parameters()).device
    inputs = parity_inputs(model.config.vocab_size, tokenizer)
    diffs, note = [], None
    was_training = model.training
    model.eval()
    try:
        for ids in inputs:
            ids = ids.to(device)
            ours, note = _one_loop_logits(model, ids, source.config.num_hidden_layers)
            if ours is None:  # no 1-loop form: the converted model's own logits must still be finite
                _check_finite(model(ids, use_cache=False).logits, "logits")
                break
            _check_finite(ours, "1-loop parity logits")
            ref = source(ids, use_cache=False).logits
            diffs.append(float((ours.float() - ref.float()).abs().max()))
    finally:
        model.train(was_training)
    report["parity_prompts"] = len(inputs)
    report["parity_max_abs_diff"] = max(diffs) if diffs and note is None else None
    report["parity_note"] = note
    report["parity_setting"] = getattr(_spec_of(model), "parity_setting", None)
    return report


def format_report(report: dict, out_dir: str | None = None) -> str:
    lines = [f"source: {report.get('source')}",
             f"parameters: source {report['source_params']:,} | new {report['params']:,} | "
             f"added {report['added_params']:+,}"]
    if report.get("parity_max_abs_diff") is not None:
        lines.append(f"1-loop parity ({report.get('parity_setting')}): max-abs-diff "
                     f"{report['parity_max_abs_diff']:.3e} over {report['parity_prompts']} prompts")
    else:
        lines.append(f"1-loop parity: n/a ({report.get('parity_note')})")
    lines.append(f"dtype: {report['dtype']}")
    if out_dir:
        lines.append(f"wrote {out_dir}")
    return "\n".join(lines)
