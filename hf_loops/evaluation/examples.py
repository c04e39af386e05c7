"""The questions `hf-loops eval` scores: `EvalExample`, rows read from a local file or a Hub dataset (`--dataset`,
`--split NAME[start:stop]`), and the final answer extracted from a text (`--answer-pattern`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..core.readers import read_jsonl

ANSWER_PATTERNS = {
    "gsm8k": r"####\s*\$?\s*([-+]?[\d,]*\.?\d+)",
    "last-number": r"([-+]?\d[\d,]*\.?\d*)(?!.*\d)",
}


# ----------------------------------------------------------------------------------------------------- data
@dataclass
class EvalExample:
    """One question: `prompt` and `completion` as chat messages (lists of dicts) or plain strings, and the
    reference text the gold answer is extracted from."""

    prompt: list | str
    completion: list | str
    reference: str


def parse_split(split: str | None) -> tuple[str, int | None, int | None]:
    """`"train"`, `"test[80:]"`, `"train[:20]"` → (name, start, stop)."""
    if not split:
        return "train", None, None
    m = re.fullmatch(r"\s*([\w.-]+)\s*(?:\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\])?\s*", split)
    if not m:
        raise ValueError(f"--split must look like NAME or NAME[start:stop], got {split!r}")
    name, a, b = m.groups()
    return name, int(a) if a else None, int(b) if b else None


def _text_field(row: dict, key: str, where: str) -> str:
    """A string field of a row: null, a number or a list is refused (never scored as the text "None")."""
    value = row[key]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: field {key!r} is {kind}; expected a string")
    return value


def row_to_example(row: dict, where: str) -> EvalExample:
    """One dataset row (question/answer, prompt/completion or messages) as an `EvalExample`; `where` names the row
    in errors."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question'+'answer', 'prompt'+'completion' or "
                         f"'messages', got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
            raise ValueError(f"{where}: 'messages' must be a list of chat messages ending with an assistant turn")
        return EvalExample(msgs[:-1], msgs[-1:], str(msgs[-1].get("content", "")))
    if "prompt" in row and "completion" in row:
        comp = row["completion"]
        ref = comp if isinstance(comp, str) else str(comp[-1].get("content", "")) if comp else ""
        return EvalExample(row["prompt"], comp, ref)
    if "question" in row and "answer" in row:
        question, answer = _text_field(row, "question", where), _text_field(row, "answer", where)
        return EvalExample([{"role": "user", "content": question}], [{"role": "assistant", "content": answer}],
                           answer)
    raise ValueError(f"{where}: expected the fields 'question'+'answer', 'prompt'+'completion' or 'messages', "
                     f"got {sorted(row)}")


def looks_like_path(spec: str) -> bool:
    """A local path rather than a Hub id (`owner/name`)."""
    return spec.startswith(("/", ".", "~")) or spec.endswith((".json", ".jsonl")) or spec.count("/") > 1


def load_examples(spec: str, split: str | None = None) -> list[EvalExample]:
    """Examples from a local .jsonl/.json file or a Hub dataset id (`split` = NAME or NAME[start:stop])."""
    name, start, stop = parse_split(split)
    if looks_like_path(spec) and not os.path.lexists(spec):
        raise ValueError(f"--dataset {spec!r}: no such file")
    if os.path.isfile(spec) or os.path.islink(spec):  # a symlink loop is the file's problem, not the Hub's
        rows, lines = read_jsonl(spec, "--dataset")
        where = (lambda i: f"{spec}:{lines[i]}") if lines else (lambda i: f"{spec}, item {i + 1}")
    else:
        try:
            from datasets import load_dataset

            rows = list(load_dataset(spec, split=name))
        except Exception as err:  # datasets raises many connection/offline/missing error types
            raise ValueError(f"--dataset {spec!r} is neither a local file nor a loadable Hub dataset "
                             f"({type(err).__name__}: {err})") from None
        where = lambda i: f"{spec}[{name}], row {i + 1}"  # noqa: E731
    examples = [row_to_example(r, where(i)) for i, r in enumerate(rows)]
    examples = examples[start:stop]
    if not examples:
        raise ValueError(f"--dataset {spec!r} (split {split or name!r}) has no examples")
    return examples


# ----------------------------------------------------------------------------------------------------- answers
def answer_regex(pattern: str) -> re.Pattern:
    """`gsm8k` (`#### N`), `last-number`, or a regular expression whose first group (or whole match) is the answer."""
    text = ANSWER_PATTERNS.get(pattern, pattern)
    try:
        return re.compile(text, re.S)
    except re.error as err:
        raise ValueError(f"--answer-pattern {pattern!r} is not a valid regular expression ({err})") from None


def extract_answer(text: str, pattern: str | re.Pattern = "gsm8k") -> str | None:
    """The normalised final answer in `text` (thousands separators, `$` and a trailing `.` removed), or None."""
    rx = pattern if isinstance(pattern, re.Pattern) else answer_regex(pattern)
    matches = list(rx.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    value = m.group(1) if m.groups() else m.group(0)
    value = value.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        f = float(value)
        return str(int(f)) if f == int(f) and abs(f) < 1e15 else repr(f)
    except ValueError:
        return value



__all__ = ["ANSWER_PATTERNS", "EvalExample", "answer_regex", "extract_answer", "load_examples", "looks_like_path",
           "parse_split", "row_to_example"]
