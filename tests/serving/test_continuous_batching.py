"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `serve --continuous-batching`) on
the looped models: the paged cache holds one slot per (iteration, layer) or per extra attention call, so greedy
`generate_batch` gives `generate`'s tokens for every prompt of a batch of different lengths (SGT head loops and Block
Loop, TaH2-fixed, adaptive TaH2 in duo and causal mode, Ouro-style dense streams). SpiralFormer and the TaH2 variants
the paged cache cannot hold are refused in one line; so are attention implementations without the paged path.
Tiny random models in fp64 (near-ties of a random model's logits cannot flip a token between the two paths), CPU sdpa."""

import argparse
import os

import pytest
import torch
from helpers.looped_tiny_configs import tiny_causal_lm
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_loops.modeling.configuration_tah2 import TAH2_PRESETS
from hf_loops.modeling.loop_utils import PAGED_EAGER_UPDATES_CACHE, PagedAttentionCache

# name -> (tiny arch, config overrides)
SERVED = {
    "sgt": ("sgt", {}),
    "sgt_masked_loops": ("sgt", {"loop_masked": True}),
    "sgt_block_loop": ("sgt", {"loop_mode": "block", "loop_plan": None, "block_loop_layers": [1],
                               "block_loop_depth": 2}),
    "tah2_fixed": ("tah2_m2", dict(TAH2_PRESETS["tah2-fixed"], max_iterations=3)),
    "tah2_adaptive_duo": ("tah2_m2", {"max_iterations": 3}),
    "tah2_adaptive_causal": ("tah2_m2", {"max_iterations": 3, "iteration_attention": "causal"}),
    "tah2_adaptive_same_iter": ("tah2_m2", {"max_iterations": 3, "iteration_attention": "same_iter"}),
    "ouro": ("tah2_m2", dict(TAH2_PRESETS["ouro"], max_iterations=3)),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 47)), [33]]


def model_of(name, seed=0):
    arch, overrides = SERVED[name]
    model = tiny_causal_lm(arch, seed=seed, **overrides)
    if name == "sgt_masked_loops":
        for layer in model.model.layers:
            layer.loop_masked = True
    return model


def cb_config(**overrides):
    return ContinuousBatchingConfig(**{"num_blocks": 32, "max_batch_tokens": 64, **overrides})


def greedy(model, prompt, max_new):
    # No EOS on either side (-1: transformers' "disabled"), so every position of both runs is compared.
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def batched(model, prompts, max_new, **cb):
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb_config(**cb))
    results = list(out.values())
    assert [r.error for r in results] == [None] * len(prompts)
    return [r.generated_tokens for r in results]


def test_a_fixed_config_runs_several_depths_and_an_adaptive_one_mixes_depths():
    """The comparisons below would be weak if every token stopped at depth 1: the fixed model runs M = 3 depths, the
    adaptive one (decisive decider) a mix."""
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        fixed = model_of("tah2_fixed")(ids, use_cache=False).iter_counts
        adaptive = model_of("tah2_adaptive_duo")(ids, use_cache=False).iter_counts
    assert fixed.unique().tolist() == [3]
    assert len(adaptive.unique()) > 1


@pytest.mark.parametrize("name", sorted(SERVED))
def test_generate_batch_equals_greedy_generate(name):
    model = model_of(name)
    want = [greedy(model, p, 6) for p in PROMPTS]
    assert batched(model, PROMPTS, 6) == want


@pytest.mark.skipif(PAGED_EAGER_UPDATES_CACHE, reason="this transformers' paged|eager writes the cache itself")
def test_eager_runs_as_paged_eager():
    """An eager model runs as 'paged|eager' (the manager's switch), and gets eager back afterwards."""
    for name in ("sgt", "tah2_fixed"):
        model = model_of(name)
        model.set_attn_implementation("eager")
        want = [greedy(model, p, 4) for p in PROMPTS]
        assert batched(model, PROMPTS, 4) == want
        assert model.config._attn_implementation == "eager"


def test_chunked_prefill_and_decode_share_the_slots():
    """A batch budget smaller than the prompts: prompts are prefilled in chunks over several steps, and every loop
    slot's keys written by earlier chunks are read back by later ones."""
    for name in ("sgt", "tah2_adaptive_duo", "tah2_fixed"):
        model = model_of(name)
        want = [greedy(model, p, 5) for p in PROMPTS]
        assert batched(model, PROMPTS, 5, max_batch_tokens=8, page_size=4) == want, name


@pytest.mark.parametrize("name", ["sgt", "tah2_fixed", "tah2_adaptive_duo"])
def test_randomized_prompt_lengths_batch_sizes_and_lengths(name):
    g = torch.Generator().manual_seed(1234 + len(name))
    model = model_of(name, seed=3)
    for _ in range(3):
        batch = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(1, 30, (batch,), generator=g).tolist()
        prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
        max_new = int(torch.randint(1, 8, (1,), generator=g))
        want = [greedy(model, p, max_new) for p in prompts]
        assert batched(model, prompts, max_new) == want, (lengths, max_new)


@pytest.mark.parametrize("name,slots", [("sgt", 2 + 3), ("sgt_block_loop", 2 + 2), ("tah2_fixed", 1 * 2),
                                        ("tah2_adaptive_duo", 3 * 2 + 1), ("ouro", 3 * 2)])
def test_every_paged_slot_is_allocated_and_written(name, slots, monkeypatch):
    """The manager's cache has the model's slots (base layers + one per loop / Block Loop repeat for SGT; per
    persisted stream and layer, plus the depth metadata of an adaptive model, for TaH2), and each is written."""
    model = model_of(name)
    written = set()
    update = PagedAttentionCache.update

    def spy(self, key_states, value_states, layer_idx, kwargs):
        written.add(layer_idx)
        return update(self, key_states, value_states, layer_idx, kwargs)

    monkeypatch.setattr(PagedAttentionCache, "update", spy)
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1),
                                             cb_config())
    assert manager.model.config.num_hidden_layers == slots
    assert len(model.paged_cache_layer_types()) == slots
    assert model.config.num_hidden_layers == 2  # the model's own config is untouched
    batched(model, PROMPTS[:2], 2)
    assert written == set(range(slots))


def test_wrong_slots_would_be_caught():
    """Negative control: with every SGT loop writing the base layer's slot, generate_batch gives other tokens."""
    model = model_of("sgt")
    want = [greedy(model, p, 6) for p in PROMPTS]
    model.model._loop_slots = lambda: ([[0, 0], [1]], 2)
    model.paged_cache_layer_types = lambda: ["full_attention"] * 2
    assert batched(model, PROMPTS, 6) != want


def one_line_error(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_spiralformer_is_refused_in_one_line():
    model = tiny_causal_lm("spiralformer")
    gc = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1)
    one_line_error(lambda: model.generate_batch([[5, 6, 7]], generation_config=gc),
                   "^SpiralFormerForCausalLM cannot run under transformers' continuous batching: .*chunk latents")
    one_line_error(lambda: model.init_continuous_batching(gc), "chunk latents")


@pytest.mark.parametrize("overrides,match", [
    ({"max_iterations": 3, "core_adapter": "huginn", "iteration_attention": "same_iter", "decider": "always",
      "mixture": "final", "updater": "identity"}, "Huginn-style"),
    ({"decider": "exit_gate", "iteration_attention": "same_iter", "mixture": "final", "updater": "hidden"},
     "exit gate"),
    ({"decision_mode": "sample"}, "decision_mode='sample'"),
])
def test_tah2_variants_the_paged_cache_cannot_hold_are_refused(overrides, match):
    model = tiny_causal_lm("tah2_m2", **overrides)
    gc = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1)
    one_line_error(lambda: model.generate_batch([[5, 6, 7]], generation_config=gc),
                   f"^TaH2ForCausalLM cannot run under transformers' continuous batching: .*{match}")


def test_attention_without_the_paged_path_is_refused():
    model = model_of("sgt")
    model.set_attn_implementation("flex_attention")
    one_line_error(lambda: model.init_continuous_batching(GenerationConfig(max_new_tokens=2)),
                   "attn_implementation 'sdpa'.* got 'flex_attention'")
    if PAGED_EAGER_UPDATES_CACHE:  # transformers before 5.24: sdpa only
        model.set_attn_implementation("eager")
        one_line_error(lambda: model.init_continuous_batching(GenerationConfig(max_new_tokens=2)),
                       "'sdpa' on this transformers .* got 'eager'")


# ----------------------------------------------------------------------------------------------------------------------
# hf-loops serve --continuous-batching
# ----------------------------------------------------------------------------------------------------------------------

HTTP_ARCHS = {"sgt": {"loop_plan": [{"layer": 1, "heads": [0, 3], "depth": 2}]},
              "tah2": dict(TAH2_PRESETS["tah2-fixed"], max_iterations=2)}


def exported(arch, folder):
    import test_http_serve as http
    from helpers.common import tiny_qwen3
    from helpers.conversion_helpers import tiny_tokenizer

    from hf_loops.conversion import convert_qwen3, export

    tok = tiny_tokenizer()
    tok.chat_template = http.CHAT_TEMPLATE
    model = convert_qwen3(tiny_qwen3(0, num_hidden_layers=4, eos_token_id=96), arch, **HTTP_ARCHS[arch])
    export(model, folder, tokenizer=tok, model_card=False)
    return str(folder)


SLOT_RECORDER = """import os
if os.environ.get("HF_LOOPS_TEST_SLOTS"):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    _update = PagedAttentionCache.update

    def _recording_update(self, key, value, layer_idx, kwargs):
        with open(os.environ["HF_LOOPS_TEST_SLOTS"], "a") as f:
            f.write(f"{layer_idx}\\n")
        return _update(self, key, value, layer_idx, kwargs)

    PagedAttentionCache.update = _recording_update
"""


def recorded_paged_cache_slots(folder, monkeypatch):
    """The paged-cache slots the server writes, as a callable giving the set so far. Before transformers 5.25 the
    server runs its model in this process (a patch here sees it); from 5.25 in spawned processes, which import the
    recorder as their `sitecustomize` (on PYTHONPATH) and append to a file."""
    from hf_loops.core.compat import serve_loads_models_in_their_own_process

    if not serve_loads_models_in_their_own_process():
        slots = set()
        update = PagedAttentionCache.update
        monkeypatch.setattr(PagedAttentionCache, "update",
                            lambda self, k, v, layer_idx, kwargs: slots.add(layer_idx) or update(self, k, v,
                                                                                                 layer_idx, kwargs))
        return lambda: slots
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SLOT_RECORDER)
    record = folder / "slots.txt"
    monkeypatch.setenv("HF_LOOPS_TEST_SLOTS", str(record))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return lambda: {int(line) for line in record.read_text().split()} if record.exists() else set()


@pytest.mark.parametrize("arch", sorted(HTTP_ARCHS))
@pytest.mark.slow
def test_served_with_continuous_batching_answers_like_greedy_generate(arch, tmp_path, monkeypatch):
    http = pytest.importorskip("test_http_serve")
    from hf_loops.serving.http import add_arguments, serve

    slots = recorded_paged_cache_slots(tmp_path / "slots", monkeypatch)
    folder = exported(arch, tmp_path / arch)
    port = http.free_port()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([folder, "--port", str(port), "--device", "cpu", "--continuous-batching",
                              "--cb-num-blocks", "64", "--cb-max-batch-tokens", "128"])
    server = serve(args, non_blocking=True)
    try:
        http.wait_until_healthy(port, 60)
        want, n = http.greedy_text(folder)
        assert n == http.MAX_TOKENS and want
        text, completion_tokens = http.chat(port, stream=False)
        assert text == want and completion_tokens == n
        streamed, _ = http.chat(port, stream=True)
        assert streamed == want
        from transformers import AutoModelForCausalLM

        types = AutoModelForCausalLM.from_pretrained(folder).paged_cache_layer_types()
        assert slots() == set(range(len(types)))  # batched through the paged cache, every loop slot written
        assert len(types) == {"sgt": 4 + 2, "tah2": 4}[arch]  # TaH2-fixed (causal): deeper states stay in the call
    finally:
        server.kill_server()

# SpiralFormer refused by `hf-loops serve --continuous-batching`: tests/serving/test_http_serve.py.


def test_serve_refuses_flash_with_continuous_batching_in_one_line(tmp_path):
    from hf_loops.serving.http import check_model

    folder = exported("sgt", tmp_path / "sgt")
    check_model(folder, True)  # served
    one_line_error(lambda: check_model(folder, True, "flash_attention_2"),
                   "--continuous-batching serves sgt with --attn-implementation sdpa or eager")
