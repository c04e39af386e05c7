"""SGT served by vLLM (CPU, eager) through the hf_loops plugin: greedy tokens and their log-probabilities equal our
HF `generate` in fp32, under continuous batching, chunked prefill and prefix caching (the engine settings and the
prompts of the TaH2 tests). Runs in `.venv-vllm` (`make test-vllm`); the reference side runs in the same environment.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm")

from test_vllm_tah2 import (  # the shared engine settings and helpers
    NEW_TOKENS,
    PROMPTS,
    Reference,
    close,
    greedy,
    make_llm,
    max_logprob_gap,
    run_staggered,
    tokens_and_logprobs,
)

# 4 heads over 2 kv heads (GQA); kept heads that straddle both kv heads, a depth-2 loop, a single-head loop
QWEN = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = {
    "heads": {"loop_plan": [{"layer": 0, "heads": [1, 2], "depth": 2}, {"layer": 2, "heads": [3], "depth": 1}]},
    "block": {"loop_mode": "block", "block_loop_layers": [1], "block_loop_depth": 2},
}


REFERENCE = Reference({name: {"seed": 10 + i, "arch": "sgt", "sgt": sgt, "qwen": QWEN, "prompts": PROMPTS,
                              "max_new_tokens": NEW_TOKENS} for i, (name, sgt) in enumerate(MODELS.items())},
                      "vllm_sgt")


@pytest.fixture(scope="module")
def references():
    try:
        yield REFERENCE.wait()
    finally:
        REFERENCE.cleanup()


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_hf_generate(references, name):
    ref = references[name]
    assert ref["tokens"] != ref["no_loop_tokens"]  # the loops change the answer: the comparison can fail
    llm = make_llm(ref["model"], stats=False)
    try:
        outs = run_staggered(llm, PROMPTS, greedy())
    finally:
        close(llm)
    tokens, logprobs = tokens_and_logprobs(outs)
    assert tokens == ref["tokens"]
    assert max_logprob_gap(logprobs, ref["logprobs"]) < 1e-4  # the same distribution, not only the same argmax
    assert outs[1].num_cached_tokens >= 32  # the shared prefix came from the prefix cache


def test_loop_passes_follow_the_config():
    from hf_loops.modeling.configuration_sgt import SGTConfig
    from hf_loops.serving.vllm_sgt import loop_passes

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32)
    assert loop_passes(SGTConfig(**small, **MODELS["heads"])) == [(2, [1, 2]), (0, None), (1, [3])]
    assert loop_passes(SGTConfig(**small, **MODELS["block"])) == [(0, None), (2, None), (0, None)]
    assert loop_passes(SGTConfig(**small)) == [(0, None)] * 3
