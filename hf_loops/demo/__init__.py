"""`hf-loops demo` (`make demo`): post-train the embedded base as Standard and TaH2 (and TaH2-fixed on the arithmetic
task), evaluate, report (the command's own help: `cli`).

- `settings`: the shared training settings, sizes, seeds, run names; `RunJob` and `ArithmeticOptions`;
- `runs`: the float32 base, one run post-trained and evaluated, the pool of worker processes;
- `stats`: numbers over seeds (ratios to Standard, CPU time), their tables and the verdict;
- `arithmetic_task`: `hf-loops demo --task arithmetic` (its runs, report, pictures);
- `gsm8k`: `run_demo`, the question/answer pipeline (split, runs, eval.json, pictures);
- `report`: the combined report.md;
- `walkthrough`: `hf-loops demo --random`;
- `cli`: `add_demo_arguments`, `demo_command`, `main`.

The task generators are `hf_loops.data.arithmetic` and `hf_loops.data.depth_task`.
"""

from .arithmetic_task import run_arithmetic_demo
from .cli import main
from .gsm8k import run_demo, split_rows
from .runs import float32_base, train_one
from .settings import DEMO_TRAINING, ArithmeticOptions, RunJob
from .walkthrough import random_walkthrough

__all__ = ["DEMO_TRAINING", "ArithmeticOptions", "RunJob", "float32_base", "main", "random_walkthrough",
           "run_arithmetic_demo", "run_demo", "split_rows", "train_one"]
