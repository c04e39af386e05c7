"""`hf-loops eval --task NAME`: problems generated fresh from a seed instead of read from `--dataset`, and the task's
one-object summary (`--json`).

`hop` (`hf_loops.data.hop_task`): k-hop lookup in an in-context permutation, every result letter labelled by its hop
count ("copy", "1", ..., str(max_hops)); `--n-sym` / `--n-queries` / `--max-hops` set the `HopTaskSpec`. Exact match
compares the whole answer line (every restated query with its result, `hop_task.ANSWER_PATTERN`).

`depth` (`hf_loops.data.depth_task`): fixed-width addition written most significant digit first, every answer
character labelled by the carry reach that decides it ("copy", "1", ..., str(digits + 1)). `--n` problems of the
`--split` (default test) split drawn with `--data-seed`, `--digits` / `--nine-prob` set the `DepthTaskSpec`. They are
scored by `metrics.evaluate` like any dataset (the GSM8K `#### N` answer pattern); `depth_summary` reads its result:
exact match, answer NLL, teacher-forced and generated depth, decode FLOPs ÷ the Standard formula's for the same
prompt and generated lengths, and per difficulty level the teacher-forced argmax accuracy and share of deep tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data import depth_task, hop_task
from .examples import EvalExample, row_to_example

TASKS = ("depth", "hop")
# The fields of `hf-loops eval --task depth --json`, in order.
DEPTH_SUMMARY_FIELDS = ("exact_match", "answer_nll", "mean_depth", "generated_depth", "decode_flops_ratio",
                        "train_time_ratio", "by_difficulty")


@dataclass(frozen=True)
class DepthTaskRun:
    """Which depth-task problems to score: `n` problems of `split`, drawn with `seed`, from `spec`."""

    spec: depth_task.DepthTaskSpec
    n: int
    seed: int = 0
    split: str = "test"
    answer_pattern = "gsm8k"  # what exact match compares: the `#### N` line
    name = "depth"

    def rows(self) -> list[dict]:
        """The problems ({"question", "answer", "labels", "a", "b"}), the same for the same settings."""
        try:
            return depth_task.make_split(self.split, self.n, self.seed, self.spec)
        except ValueError as err:  # too few distinct problems for --n
            raise ValueError(f"--n {self.n}: {err}") from None

    def examples(self, rows: list[dict] | None = None) -> list[EvalExample]:
        """The problems as chat examples (the question as the user turn, the answer as the assistant's)."""
        rows = self.rows() if rows is None else rows
        return [row_to_example({"question": r["question"], "answer": r["answer"]}, f"problem {i + 1}")
                for i, r in enumerate(rows)]

    def describe(self) -> str:
        """What the result records as its dataset."""
        return (f"depth task (digits={self.spec.digits}, nine_prob={self.spec.nine_prob}, {self.split} split, "
                f"seed {self.seed}, {self.n} problems)")

    def max_new_tokens(self) -> int:
        """A generation length that fits every answer: its longest text (one token per character at most) and the
        end of turn."""
        top = 10 ** self.spec.digits - 1
        return len(depth_task.render(top, top, self.spec.digits)["answer"]) + 1


@dataclass(frozen=True)
class HopTaskRun(DepthTaskRun):
    """Which hop-task problems to score: `n` problems of `split`, drawn with `seed`, from `spec`."""

    spec: hop_task.HopTaskSpec
    answer_pattern = hop_task.ANSWER_PATTERN  # the whole answer line
    name = "hop"

    def rows(self) -> list[dict]:
        """The problems ({"question", "answer", "labels"}), the same for the same settings."""
        try:
            return hop_task.make_split(self.split, self.n, self.seed, self.spec)
        except ValueError as err:
            raise ValueError(f"--n {self.n}: {err}") from None

    def describe(self) -> str:
        s = self.spec
        return (f"hop task (n_sym={s.n_sym}, n_queries={s.n_queries}, max_hops={s.max_hops}, {self.split} split, "
                f"seed {self.seed}, {self.n} problems)")

    def max_new_tokens(self) -> int:
        """The answer's length (one token per character at most) and the end of turn."""
        return hop_task.answer_length(self.spec) + 1


def _flag_error(err: ValueError, fields: tuple[tuple[str, str], ...]) -> ValueError:
    """`err` ("field must be ...") with the field's flag in its place."""
    text = str(err)
    for field, flag in fields:
        if text.startswith(field + " "):
            text = flag + text[len(field):]
    return ValueError(text)


def _check_run_flags(n: int, seed: int, split: str, task: str) -> None:
    from ..core.numbers import check_int

    check_int("--n", n, 1)
    check_int("--data-seed", seed, 0)
    if split not in depth_task.SPLITS:
        raise ValueError(f"--split with --task {task} must be one of {', '.join(depth_task.SPLITS)}, got {split!r}")


def hop_task_run(n: int, seed: int = 0, n_sym: int = 8, n_queries: int = 4, max_hops: int = 2, split: str = "test"
                 ) -> HopTaskRun:
    """A `HopTaskRun` from the command's flags; a bad value is refused naming its flag."""
    _check_run_flags(n, seed, split, "hop")
    try:
        spec = hop_task.HopTaskSpec(n_sym=n_sym, n_queries=n_queries, max_hops=max_hops)
    except ValueError as err:
        raise _flag_error(err, (("n_sym", "--n-sym"), ("n_queries", "--n-queries"), ("max_hops", "--max-hops"))
                          ) from None
    return HopTaskRun(spec, n, seed, split)


def depth_task_run(n: int, seed: int = 0, digits: int = 4, nine_prob: float = 0.3, split: str = "test"
                   ) -> DepthTaskRun:
    """A `DepthTaskRun` from the command's flags; a bad value is refused naming its flag."""
    _check_run_flags(n, seed, split, "depth")
    try:
        spec = depth_task.DepthTaskSpec(digits=digits, nine_prob=nine_prob)
    except ValueError as err:  # "digits must be ..." / "nine_prob must be ...": name the flag
        raise _flag_error(err, (("digits", "--digits"), ("nine_prob", "--nine-prob"))) from None
    return DepthTaskRun(spec, n, seed, split)


def depth_summary(result: dict, rows: list[dict], spec: depth_task.DepthTaskSpec | hop_task.HopTaskSpec, config,
                  prompt_lengths: list[int]
                  ) -> dict:
    """The `--json` object of one `evaluate` result on `rows` (its examples in the same order, evaluated with
    `token_accuracy=True`). `config`: the model's config; `prompt_lengths`: each problem's prompt tokens (for the
    Standard formula's FLOPs at the same prompt and generated lengths). `train_time_ratio` is None: an evaluation
    does not know how long training took."""
    from ..core.flops_tah2 import decode_flops_standard

    m, items = result["metrics"], result["examples"]
    if len(items) != len(rows) or len(prompt_lengths) != len(rows):
        raise ValueError(f"depth_summary: {len(items)} results, {len(rows)} problems, {len(prompt_lengths)} prompts")
    standard = sum(decode_flops_standard(config, p, max(e["generated_tokens"] - 1, 0))
                   for e, p in zip(items, prompt_lengths, strict=True))
    measured = sum(e["decode_flops"] for e in items)
    per_token = []
    for e, r in zip(items, rows, strict=True):
        if "answer_top1" not in e:
            raise ValueError("depth_summary needs a result evaluated with token_accuracy=True")
        item = {"labels": depth_task.token_labels(e["answer_tokens"], r["answer"], r["labels"]),
                "correct": e["answer_top1"]}
        if "answer_depths" in e:
            item["depths"] = e["answer_depths"]
        per_token.append(item)
    stats = depth_task.level_stats(per_token)
    empty = {"tokens": 0, "accuracy": None, "deep_share": None}
    by_difficulty = {level: {k: stats.get(level, empty)[k] for k in ("accuracy", "deep_share", "tokens")}
                     for level in spec.levels}
    return {
        "exact_match": m["exact_match"],
        "answer_nll": m["answer_nll"],
        "mean_depth": m.get("mean_depth"),
        "generated_depth": m.get("mean_depth_generated"),
        "decode_flops_ratio": measured / standard if standard else None,
        "train_time_ratio": None,
        "by_difficulty": by_difficulty,
    }


def task_summary(ckpt: str, result: dict, task: DepthTaskRun, rows: list[dict], examples) -> dict:
    """`depth_summary` of checkpoint `ckpt`'s `evaluate` result on `task`'s `rows` (as `examples`), with the
    checkpoint's config and each problem's prompt length: what `hf-loops eval --task NAME --json` prints and the demo
    records per run."""
    from transformers import AutoConfig, AutoTokenizer

    from .decoding import tokenize_example

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompt_lengths = [len(tokenize_example(tokenizer, ex)[0]) for ex in examples]
    return depth_summary(result, rows, task.spec, AutoConfig.from_pretrained(ckpt), prompt_lengths)


__all__ = ["DEPTH_SUMMARY_FIELDS", "TASKS", "DepthTaskRun", "HopTaskRun", "depth_summary", "depth_task_run",
           "hop_task_run", "task_summary"]
