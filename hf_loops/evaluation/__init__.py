"""`hf-loops eval` and `evaluate(model_or_path, dataset=...)`: answer NLL, exact match, depth, decode FLOPs, tokens/s of
a TaH2, SpiralFormer, SGT or plain Qwen3 checkpoint on question/answer examples (the command's own help: `cli`).

- `examples`: `EvalExample`, the rows of a file or Hub dataset, the answer patterns and `extract_answer`;
- `models`: a checkpoint checked and loaded, its display name, the loop knobs it takes;
- `decoding`: tokenisation, left padding, the teacher-forced pass, batched greedy generation, decider decisions;
- `metrics`: `evaluate`, the per-example records, the summary and `depth_metrics`;
- `report`: the comparison table (markdown/console), details, pictures, `write_eval`;
- `tasks`: problems generated from a seed (`--task depth`) and their `--json` summary;
- `cli`: `add_eval_arguments`, `cmd_eval`, `main`.
"""

from .cli import main
from .decoding import tokenize_example
from .examples import EvalExample, extract_answer, load_examples, parse_split
from .metrics import evaluate
from .models import load_model
from .report import comparison_rows, write_eval

__all__ = ["EvalExample", "comparison_rows", "evaluate", "extract_answer", "load_examples", "load_model", "main",
           "parse_split", "tokenize_example", "write_eval"]
