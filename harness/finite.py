"""Non-finite values fail every comparison, and say so.

Python's ``max()`` skips a NaN unless it comes first (every comparison with NaN is False), and
``value <= limit`` is False for NaN but ``max(d) <= limit`` can pass over one. Every check of the harness
- layouts against each other, against goldens and references, the fault catalogue's checks, the
nightly, the benchmarks' targets - goes through these helpers, so a NaN or an infinity anywhere in
what it compares is a failure that names the first offending step (``step 7: loss is nan``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def is_finite_number(x) -> bool:
    """A real, finite int or float (bools are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def first_nonfinite(values: Iterable) -> tuple[int, object] | None:
    """(index, value) of the first entry that is not a finite number, or None."""
    for i, v in enumerate(values):
        if not is_finite_number(v):
            return i, v
    return None


def nonfinite_message(values: Sequence, what: str = "loss", who: str = "") -> str | None:
    """``step 7: loss is nan`` (``who`` prefixes the quantity: ``step 7: golden bshd loss is inf``) for the first
    non-finite entry of a per-step series (step = index + 1), or None when every entry is finite."""
    bad = first_nonfinite(values)
    if bad is None:
        return None
    i, v = bad
    shown = f"{v!r}" if not isinstance(v, float) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
    subject = " ".join(x for x in (who, what) if x)
    return f"step {i + 1}: {subject} is {shown}"


def worst(values: Iterable[float]) -> float:
    """The largest value, NaN-propagating: NaN if any value is NaN (``max()`` would skip it); 0.0 when empty."""
    out = 0.0
    for v in values:
        if v != v:  # NaN
            return math.nan
        out = max(out, v)
    return out


def badness(value: float) -> float:
    """A sort key under which NaN is the worst value (``max(xs, key=badness)`` picks a NaN over any number)."""
    return math.inf if value != value else value


def worst_of(items, key, *, high_is_bad: bool = True):
    """The item whose ``key`` is worst: the largest (``high_is_bad``) or the smallest, a NaN key before any
    number (``max``/``min`` with a plain key would pass over it)."""
    sign = 1.0 if high_is_bad else -1.0
    return max(items, key=lambda it: badness(sign * key(it)))


def within(value, limit: float, op: str = "<=") -> bool:
    """``value op limit`` that is False for any non-finite ``value`` (NaN, inf, or not a number at all)."""
    if not is_finite_number(value):
        return False
    return value <= limit if op == "<=" else value >= limit if op == ">=" else value < limit if op == "<" \
        else value > limit if op == ">" else _bad_op(op)


def _bad_op(op: str) -> bool:
    raise ValueError(f"comparison {op!r} must be one of <=, >=, <, >")


def target(name: str, value, limit: float, op: str = "<=", **extra) -> dict:
    """A benchmark or verdict target ``{"target", "value", "limit", "pass"}`` that fails on a non-finite
    value and says so in ``"why"``."""
    out = {"target": name, "value": value, "limit": limit, "pass": within(value, limit, op), **extra}
    if not is_finite_number(value):
        out["why"] = f"value is {value!r}: not a finite number"
    return out
