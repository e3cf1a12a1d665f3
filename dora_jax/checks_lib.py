"""What counts as a count: one definition for every config field and constructor argument.

A bool is not a count (`True` would pass as 1 and hide a misplaced flag), nor is a float even
when whole (`2.0` slots or `1.5` iterations is a typo, where `int()` would quietly round);
NumPy integers are (configs computed with NumPy). Each caller words its own error, naming the
field as its user wrote it.
"""

from __future__ import annotations

import operator
from typing import Any


def as_integer(value: Any) -> int | None:
    """`value` as an int if it is an integer of any kind (Python, NumPy), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_count(value: Any, least: int) -> bool:
    """Whether `value` is an integer (`as_integer`) of at least `least`."""
    number = as_integer(value)
    return number is not None and number >= least
