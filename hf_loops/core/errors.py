"""The commands' error boundary, written once (stdlib only).

A user's mistake (a bad value, a missing or unreadable file, a location that cannot be written, a malformed recipe)
ends the command with ONE line on stderr, `error: ...`, and exit code 2. Anything else is a bug of ours: exit code 1
with its last line and a hint to rerun with `--debug`, which shows the full traceback in both cases."""

from __future__ import annotations

import sys

__all__ = ["DEBUG_HINT", "UserError", "is_user_error", "one_line", "run_command"]

DEBUG_HINT = "(rerun with --debug for the traceback)"


class UserError(ValueError):
    """A bad input named in words; a `ValueError`, so Python callers catch it as one."""


def _yaml_error_types() -> tuple[type, ...]:
    mod = sys.modules.get("yaml")  # only if a recipe was read: importing yaml here would cost every command
    return (mod.YAMLError,) if mod is not None else ()


def is_user_error(err: BaseException) -> bool:
    """Bad input rather than a bug: ValueError (UnicodeDecodeError and our UserError included), OSError (missing,
    unwritable, full disk), a YAML syntax error or a refused YAML tag."""
    return isinstance(err, (ValueError, OSError) + _yaml_error_types())


def one_line(err: BaseException, last: bool = False) -> str:
    """The message of `err` on one line (an OSError shows its errno text and the path it names); `last`: only its last
    line (a bug's message: the line that says what failed)."""
    if isinstance(err, OSError) and err.strerror:
        text = err.strerror if err.filename is None else f"{err.filename}: {err.strerror}"
    else:
        text = str(err)
    if _yaml_error_types() and isinstance(err, _yaml_error_types()):
        problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
        if problem:  # the problem and where, rather than the YAML snippet with its caret line
            text = problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")
        text = f"recipe is not valid YAML: {' '.join(text.split())}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return " ".join(lines) if len(lines) <= 3 and not last else lines[-1]


def _close_progress_bars() -> None:
    """Close the bars a failed run left open (the Trainer's, datasets'), so that they do not redraw themselves below
    the error message when they are garbage-collected."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:
            pass


def run_command(func, *args, debug: bool = False) -> int:
    """`func(*args)` as a command: its int return value (None → 0) is the exit code; a user error → one line and 2;
    any other exception → its last line and 1; `debug` re-raises both with the traceback; Ctrl-C → 130."""
    try:
        code = func(*args)
    except KeyboardInterrupt:
        if debug:
            raise
        _close_progress_bars()
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        _close_progress_bars()
        sys.stdout.flush()
        if is_user_error(err):
            print(f"\nerror: {one_line(err)}", file=sys.stderr)
            return 2
        print(f"\n{type(err).__name__}: {one_line(err, last=True)} {DEBUG_HINT}", file=sys.stderr)
        return 1
    return 0 if code is None else int(code)
