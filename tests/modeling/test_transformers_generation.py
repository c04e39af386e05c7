"""Our own equivalents of the generation checks transformers runs on every architecture (its `tests/generation/`
folder is not in the sdist), on the four configurations of the common tests: TaH2 M = 1, TaH2 M = 2 with a learned
decider, SpiralFormer, SGT.

- greedy, beam search and seeded sampling give the same tokens with and without the cache;
- a left-padded batch gives each row the tokens it gets alone;
- `num_return_sequences` returns the expanded batch (sampling: equal to generating from the repeated prompt with the
  same seed; beams: the best beam first, equal to the single-sequence result);
- generation stops at the first EOS and pads the finished row.
"""

from __future__ import annotations

import pytest
import torch
from helpers.looped_tiny_configs import ARCHS, tiny_causal_lm

PAD = ARCHS["tah2_m1"]["config"]["pad_token_id"]
VOCAB = ARCHS["tah2_m1"]["config"]["vocab_size"]
NEW = 8

pytestmark = pytest.mark.parametrize("arch", list(ARCHS))

_MODELS: dict[str, torch.nn.Module] = {}


def model_of(arch: str):
    """One model per architecture for the whole module (building is the slow part of these tiny runs)."""
    if arch not in _MODELS:
        _MODELS[arch] = tiny_causal_lm(arch, seed=11)
    return _MODELS[arch]


def prompts(lengths, seed=0):
    """Left-padded random prompts (ids 3.. so no pad / bos / eos inside) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, seed=None, **kw):
    kw = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kw}
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)


MODES = {
    "greedy": dict(),
    "beam": dict(num_beams=3),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0, seed=5),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_cache_equals_no_cache(arch, mode):
    model = model_of(arch)
    ids, mask = prompts([5, 3, 6], seed=1)
    with_cache = generate(model, ids, mask, use_cache=True, **MODES[mode])
    without = generate(model, ids, mask, use_cache=False, **MODES[mode])
    assert with_cache.shape == (3, 6 + NEW)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache[:, :6], ids)


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_left_padded_batch_equals_each_row_alone(arch, mode):
    model = model_of(arch)
    lengths = [4, 7, 2]
    ids, mask = prompts(lengths, seed=2)
    batch = generate(model, ids, mask, **MODES[mode])
    for row, n in enumerate(lengths):
        alone = generate(model, ids[row:row + 1, -n:], mask[row:row + 1, -n:], **MODES[mode])
        assert torch.equal(batch[row, -NEW:], alone[0, -NEW:]), f"row {row}"


def test_num_return_sequences_sampling_is_the_repeated_prompt(arch):
    model = model_of(arch)
    ids, mask = prompts([5, 3], seed=3)
    k = 3
    sampled = generate(model, ids, mask, do_sample=True, top_k=0, num_return_sequences=k, seed=9)
    repeated = generate(model, ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), do_sample=True, top_k=0,
                        seed=9)
    assert sampled.shape == (2 * k, 5 + NEW)
    assert torch.equal(sampled, repeated)
    assert len({tuple(r.tolist()) for r in sampled[:k, -NEW:]}) > 1, "three samples of one prompt all equal"


def test_num_return_sequences_beams_best_first(arch):
    model = model_of(arch)
    ids, mask = prompts([5, 3], seed=4)
    best = generate(model, ids, mask, num_beams=3)
    out = generate(model, ids, mask, num_beams=3, num_return_sequences=2, output_scores=True,
                   return_dict_in_generate=True)
    assert out.sequences.shape == (4, 5 + NEW)
    assert torch.equal(out.sequences[0::2], best)
    assert (out.sequences_scores[0::2] >= out.sequences_scores[1::2]).all()
    assert not torch.equal(out.sequences[0::2], out.sequences[1::2])


def test_stops_at_the_first_eos(arch):
    model = model_of(arch)
    ids, mask = prompts([5, 4], seed=6)
    free = generate(model, ids, mask, max_new_tokens=10)[:, ids.shape[1]:]
    eos = int(free[0, 3])  # a token the first row produces at step 4 (or earlier)
    ends = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else row.shape[0] for row in free]
    new = generate(model, ids, mask, max_new_tokens=10, eos_token_id=eos)[:, ids.shape[1]:]
    # every row ends at its first EOS and then pads; generation stops when every row has ended
    assert new.shape[1] == max(ends)
    for row, end in enumerate(ends):
        assert torch.equal(new[row, :end], free[row, :end]), f"row {row}"
        assert (new[row, end:] == PAD).all(), f"row {row}"
    assert ends[0] <= 4
