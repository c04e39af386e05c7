"""`hf-loops reproduce NAME`: the papers' headlines at CPU scale, from the same seeds on the same shipped data, with a
report, pictures and a `summary.json` per claim.

- `spiralformer` (`hf_loops.reproduce.spiralformer`): SpiralFormer-B vs LoopedFormer vs Standard at equal parameters
  and tokens on the shipped Shakespeare slice: held-out loss, prefill FLOPs ÷ LoopedFormer, and the coarse-to-fine
  probes per loop (local attention mass, key-marginal entropy).
- `sgt` (`hf_loops.reproduce.sgt`): vanilla vs Block Loop vs SGT (head loops grown by Algorithm 1, then frozen) on the
  same text: held-out loss, training FLOPs ÷ vanilla, where growth put the loops.
- `analysis` (`hf_loops.reproduce.analysis`): the mechanistic analysis's fixed-point and stage probes, with the paper's
  thresholds, on the looped models the other runs train (LoopedFormer with the anchor topology, Block Loop, the demo's
  TaH2): the share of tokens at a fixed point, degenerate vs cyclic fixed points, stage repetition and stability.
"""

NAMES = ("spiralformer", "sgt", "analysis")

__all__ = ["NAMES"]
