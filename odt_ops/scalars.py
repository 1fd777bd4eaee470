"""A scalar someone else wrote (a caller's argument, a value read from a file) as a float.

Learning rates, aggregation weights, int8 scales and round settings are all checked the same
way before use: a real number (Python's or numpy's; a bool never is one), finite, and in range.
``float()`` alone would accept ``True``, and raise OverflowError on an int past float64's range
instead of letting the caller name the value.
"""
from __future__ import annotations

import math
import numbers


def as_real(value: object) -> float | None:
    """``value`` as a float if it is a real number, +-inf for an int past float64's range; None
    for anything else (a bool, a string, None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite_at_least_zero(value: float | None, *, positive: bool = False) -> bool:
    """Whether ``value`` (as_real's) is finite and >= 0 (> 0 with ``positive``)."""
    return value is not None and math.isfinite(value) and (value > 0 if positive else value >= 0)
