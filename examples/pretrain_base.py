"""Pretrain the embedded default base model (`hf_loops/data/base/`): see `hf_loops.training.pretrain_base`.

    python examples/pretrain_base.py --out hf_loops/data/base --overwrite

(the exact command of the shipped weights is in hf_loops/data/base/README.md)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from hf_loops.training.pretrain_base import cli

if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
