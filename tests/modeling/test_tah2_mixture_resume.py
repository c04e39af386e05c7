"""`StoppingWeightedMixture.resume_at`: a mixture interrupted after some depths and continued in a new mixture
(as the vLLM model does for a decode token deferred to the next engine step) gives the log q of one uninterrupted
mixture, for every mixture kind, M, stop depth and interruption point."""

import random

import pytest
import torch

from hf_loops.modeling.modeling_tah2 import StoppingWeightedMixture


def run(kind, g, cont, logits, start=0, state=None):
    """Depths start.. of one token (a one-row mixture); returns the mixture and its (R, log ω·q) after them."""
    mix = StoppingWeightedMixture(kind, 1, 1, 1, "cpu")
    zero = torch.zeros(1, dtype=torch.long)
    if state is not None:
        mix.resume_at((zero, zero), (zero, zero), *state)
    for m in range(start, len(g)):
        w = mix.log_weights_at((zero, zero), g[m:m + 1], cont[m:m + 1])
        mix.add_distribution((zero, zero), w, logits[m:m + 1])
        if not bool(cont[m]):
            break
    return mix, (mix.remaining[0, 0].clone(), mix.log_dist[0, 0].clone())


@pytest.mark.parametrize("seed", range(12))
def test_resumed_mixture_equals_the_uninterrupted_one(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kind = ["stop_prob", "even", "final"][seed % 3]
    M = rng.choice([2, 3, 4])
    depth = rng.randint(1, M)  # the depth the token stops at (M: it runs them all)
    g = torch.rand(M)
    g[M - 1] = 0.0  # the last depth takes no decision
    cont = torch.tensor([m < depth - 1 for m in range(M)])
    logits = torch.randn(M, 50) * 3
    whole, _ = run(kind, g, cont, logits)
    expected = whole.log_probs(torch.tensor([[depth]]))
    for cut in range(1, depth):  # interrupted after `cut` depths, continued in a fresh mixture
        first = StoppingWeightedMixture(kind, 1, 1, 1, "cpu")
        zero = torch.zeros(1, dtype=torch.long)
        for m in range(cut):
            w = first.log_weights_at((zero, zero), g[m:m + 1], cont[m:m + 1])
            first.add_distribution((zero, zero), w, logits[m:m + 1])
        state = (first.remaining[0, 0].clone(), first.log_dist[0, 0].clone())
        resumed, _ = run(kind, g, cont, logits, start=cut, state=state)
        torch.testing.assert_close(resumed.log_probs(torch.tensor([[depth]])), expected, rtol=0, atol=1e-6)


def test_resume_into_several_rows_leaves_the_others():
    """Resuming rows 1 and 3 of a 4-row mixture sets exactly those rows' R and distribution."""
    mix = StoppingWeightedMixture("stop_prob", 1, 4, 4, "cpu")
    idx = torch.tensor([1, 3])
    zero = torch.zeros(2, dtype=torch.long)
    R = torch.tensor([0.25, 0.5])
    dist = torch.log_softmax(torch.randn(2, 7), -1)
    mix.resume_at((zero, idx), (zero, idx), R, dist)
    assert mix.remaining[0].tolist() == [1.0, 0.25, 1.0, 0.5]
    assert torch.equal(mix.log_dist[0, idx], dist)
    assert bool(torch.isneginf(mix.log_dist[0, [0, 2]]).all())
