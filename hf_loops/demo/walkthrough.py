"""`hf-loops demo --random`: the old walk-through, a tiny random Qwen3 converted to TaH2 generating a few tokens with
their depths (no training, no data)."""

from __future__ import annotations

RANDOM_PROMPT = "Looped transformers think harder on hard tokens."


def random_walkthrough(prompt: str, max_new_tokens: int = 16, max_iterations: int = 3, exit_threshold: float = 0.5,
                       tokenizer: str | None = None, seed: int = 0) -> None:
    """Tiny random Qwen3 → TaH2, generate, print every token with its depth (no training, no data)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..conversion import convert_qwen3
    from ..inference import generate_with_depths

    torch.manual_seed(seed)
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        vocab, encode, decode = len(tok), tok.encode, tok.decode
    else:  # bytes as tokens: no tokenizer files needed
        vocab = 256
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
        decode = lambda ids: bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    model = convert_qwen3(qwen, "tah2", max_iterations=max_iterations, exit_threshold=exit_threshold).eval()
    if model.decider is not None:  # an untrained decider sits at g ≈ 0.5; spread it so the walk-through shows depths
        with torch.no_grad():
            model.decider.score.weight.normal_(0.0, 2.0)
    trace = generate_with_depths(model, torch.tensor([encode(prompt)]), max_new_tokens=max_new_tokens)
    print(f"tiny random Qwen3 → TaH2 (M={max_iterations}, τ={exit_threshold}); prompt: {prompt!r}")
    print(f"prompt depths: {trace.prompt_depths}")
    print(f"{'step':>4}  {'token':>6}  depth  text")
    for i, (t, d) in enumerate(zip(trace.tokens, trace.depths, strict=True)):
        print(f"{i:>4}  {t:>6}  {d:>5}  {decode([t])!r}")
    mean = sum(trace.depths) / max(len(trace.depths), 1)
    print(f"mean depth over {len(trace.depths)} generated tokens: {mean:.2f}")


__all__ = ["RANDOM_PROMPT", "random_walkthrough"]
