"""Config fields: sections built from config dataclasses, and what counts as a count.

A config file's sections list every field a user may set (`dataclass_section`), so any can be
overridden from the command line. A count has one definition for every config field and
constructor argument: a Python int. A bool is not one (`True` would pass as 1 and hide a
misplaced flag), nor is a float even when whole (`2.0` slots or `1.5` iterations is a typo,
where `int()` would quietly round), nor a NumPy integer: a config holding one passes every
check and then cannot be written as JSON (the ledger, the checkpoint), after the model has
loaded. Each caller words its own error, naming the field as its user wrote it.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """Bad input that a run is refused for at start (a config field, a flag, the workdir): the
    CLI prints its message alone, since a traceback would bury the field it names."""


def as_integer(value: Any) -> int | None:
    """`value` as an int if it is an integer of any kind (Python, NumPy), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_count(value: Any, least: int) -> bool:
    """Whether `value` is a Python int (not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def from_fields(cls: type, values: Any, section: str) -> Any:
    """The config dataclass `cls` from a section's fields (a mapping or a ConfigDict); a field
    `cls` lacks is an error naming `section` (a misspelled field must not fall back to its
    default in silence). Lists become tuples: a config file writes a tuple field as a list."""
    values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{section}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def check_timeout(timeout_s: float) -> float:
    """`timeout_s` if it can bound a wait: NaN would compare false (every wait times out) and
    Thread.join refuses waits past TIMEOUT_MAX, long after start."""
    if not 0 < timeout_s <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"timeout_s={timeout_s}: must be in (0, {threading.TIMEOUT_MAX:g}] seconds"
        )
    return timeout_s


def dataclass_section(
    cls: type, name: str, values: dict[str, Any], set_elsewhere: Mapping[str, str]
) -> ml_collections.ConfigDict:
    """A config file's section `name` for the config dataclass `cls`: every field a user may
    set, at its default unless in `values`. ml_collections refuses a command-line override of
    a key its config lacks (`--config.train.kl_coef=0.05` is an AttributeError then), so a
    section that listed only the fields it changed left the others unreachable. Fields whose
    default is None are typed placeholders, so that an override still parses as a number.
    `set_elsewhere` maps each field the section must not hold to where it is set instead."""
    hints = typing.get_type_hints(cls)
    section = ml_collections.ConfigDict()
    for field in dataclasses.fields(cls):
        if field.name in set_elsewhere:
            if field.name in values:
                raise ValueError(f"{name} config field {field.name!r}: {set_elsewhere[field.name]}")
            continue
        value = values.pop(field.name, field.default)
        if value is None:
            (kind,) = [t for t in typing.get_args(hints[field.name]) if t is not types.NoneType]
            value = ml_collections.config_dict.placeholder(kind)
        section[field.name] = value
    if values:
        raise ValueError(f"{name} config: unknown field(s) {sorted(values)}")
    return section


def check_integer_fields(config: ml_collections.ConfigDict, minima: Mapping[str, int]) -> None:
    """Raises a ValueError naming the first field (a dotted path into `config`) that is not an
    integer of at least its minimum: the counts a run divides by or needs one of."""
    for field, least in minima.items():
        value = config
        for part in field.split("."):
            value = value[part]
        if not is_count(value, least):
            raise ValueError(f"{field}={value!r}: must be an integer >= {least}")
