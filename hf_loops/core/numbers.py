"""Checks of the numbers users give (stdlib only): finite, integral where a count is meant, inside a range.

An explicit value, 0 included, is checked and kept: a default applies only where the value is None (never
`value or default`, which turns an explicit 0 into the default)."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_float", "check_int", "or_default"]


def or_default(value, default):
    """`value` unless it is None (0, 0.0 and False are values)."""
    return default if value is None else value


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int; a bool, a float (even 2.0), NaN or a value outside [low, high] → `ValueError` naming
    `name`."""
    bounds = " " + _range_text(low, high, False, False) if low is not None or high is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer{bounds}, got {value}")
    return int(value)


def check_float(name: str, value, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """`value` as a finite float inside the range (open ends with `low_open` / `high_open`); NaN, ±inf, a bool or a
    non-number → `ValueError` naming `name`."""
    bounds = _range_text(low, high, low_open, high_open) if low is not None or high is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise ValueError(f"{name} must be {bounds}, got {value:g}")
    return value
