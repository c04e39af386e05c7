"""`hf-loops reproduce NAME`: the papers' headlines at CPU scale, from the same seeds on the same shipped data, with a
report, pictures and a `summary.json` per claim.

- `spiralformer` (`hf_loops.reproduce.spiralformer`): SpiralFormer-B vs LoopedFormer vs Standard at equal parameters
  and tokens on the shipped Shakespeare slice: held-out loss, prefill FLOPs ÷ LoopedFormer, and the coarse-to-fine
  probes per loop (local attention mass, key-marginal entropy).
"""

NAMES = ("spiralformer",)

__all__ = ["NAMES"]
