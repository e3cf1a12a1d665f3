"""Reward functions, looked up by the name a config gives.

A reward function is `fn(completion: str, answer: str, **options) -> float`: the decoded
response (special tokens removed) and the dataset's reference answer. Options come from the
config's `reward.options` (e.g. the `format` reward's `pattern`) and are bound once by
`get_reward`, which rejects an option the function does not take with a message naming it.

Built-ins: `exact_match`, `math` (math-verify), `format`. Anything else is a user function given
by dotted path, `"package.module:function"` or `"package.module.function"`, or registered with
`@register_reward("name")` in a module the user imports. A module in the directory the command
runs in is found, as `python -m` would find it: the installed `dora-jax` script's own path
holds only its `bin` directory.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import math_verify

RewardFn = Callable[..., float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward under `name`; registering a taken name is an error."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def _from_path(path: str) -> RewardFn:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"reward {path!r} is neither a registered reward {registered_rewards()} "
            "nor a dotted path 'package.module:function'"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # last: an installed module of the same name comes first
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"reward {path!r}: cannot import {attr!r} from {module_name!r}: {e}"
        ) from e
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    return fn


def get_reward(name: str, **options: Any) -> RewardFn:
    """The reward `name` (registered or dotted path) with `options` bound as keyword arguments."""
    fn = _REGISTRY[name] if name in _REGISTRY else _from_path(name)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for option in options:
        if not takes_any and option not in params:
            raise ValueError(f"reward.options.{option}: reward {name!r} takes no such option")
    # `RewardRunner` calls it as fn(completion, answer): a function that cannot take that call
    # would pass this start-up check and then raise on every sample, scoring 0 for the whole run.
    try:
        inspect.signature(fn).bind("completion", "answer", **options)
    except TypeError as e:
        raise ValueError(
            f"reward.name={name!r}: a reward is called as fn(completion, answer, **options), "
            f"which this one cannot take ({e})"
        ) from e
    return functools.partial(fn, **options) if options else fn


@register_reward("exact_match")
def exact_match(completion: str, answer: str) -> float:
    """1 when the completion equals the answer up to surrounding whitespace. An empty answer
    matches nothing: a data row without one would reward the policy for saying nothing."""
    return float(bool(answer.strip()) and completion.strip() == answer.strip())


@register_reward("format")
def format_reward(completion: str, answer: str, pattern: str = r"\\boxed\{.+?\}") -> float:
    """1 when the completion contains the answer pattern (regex), e.g. `<answer>.+?</answer>`.

    It checks form only, not correctness: a shaping term that teaches where to put the answer.
    """
    return float(re.search(pattern, completion, flags=re.DOTALL) is not None)


@register_reward("math")
def math_reward(completion: str, answer: str) -> float:
    r"""1 when math-verify finds the completion's final answer equal to the reference.

    Both of math-verify's own timeouts are disabled: `RewardRunner` enforces `reward.timeout_s`
    itself, and their `signal.alarm` only works in a main thread, which a reward under
    `isolation="thread"` is not.

    The reference is parsed as LaTeX first (boxed, then in `$...$`), plain text last: plain-text
    parsing extracts the first number it sees, so `2\sqrt{2}` or `3\pi` would become 2 or 3, and
    a wrong answer would score 1 and the right one 0.
    """
    if _huge_power(completion):
        return 0.0
    gold = _parse(f"$\\boxed{{{answer}}}$") or _parse(f"${answer}$") or _parse(answer)
    pred = _parse(completion)
    if not gold or not pred:
        return 0.0
    return float(math_verify.verify(gold, pred, timeout_seconds=None))


def _parse(text: str) -> list:
    return math_verify.parse(text, parsing_timeout=None)


class _WeEnforceTheTimeout(logging.Filter):
    """Drops math-verify's warning that its timeouts are off (they are, on purpose: see
    `math_reward`), which every reward worker process printed once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _module in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_module).addFilter(_WeEnforceTheTimeout())


# sympy computes a power of numbers exactly, in C, holding the GIL: one completion boxing
# `10^{10^{8}}` froze a whole run when rewards ran in threads. `RewardRunner` now kills such a
# call's worker process at the timeout; this check spares the worker a restart and still
# guards `isolation="thread"`, where nothing can stop the call. A completion that writes a
# power of numbers with an exponent that is itself a power (a tower), or one of more than
# about `_MAX_POWER_DIGITS` digits, scores 0 before sympy sees it; other slow input relies on
# the timeout.
_MAX_POWER_DIGITS = 10**6  # ~0.3 s for sympy; ten times more took 6 s
_POWER_OPERATOR = re.compile(r"\^|\*\*")
_BASE_DIGITS = re.compile(r"(\d*)[\s{}()]*$")
# The exponent's leading number, and whether it is itself raised to a number (a tower).
_EXPONENT = re.compile(r"[\s{(]*(\d+)\s*((?:\^|\*\*)[\s{(]*\d)?")


def _huge_power(text: str) -> bool:
    # Operators are found first and their operands read from there, so a long run of digits is
    # scanned a bounded number of times (a digit-led pattern would backtrack quadratically).
    for operator in _POWER_OPERATOR.finditer(text):
        exponent = _EXPONENT.match(text, operator.end())
        if exponent is None:
            continue
        digits, tower = exponent.groups()
        base = _BASE_DIGITS.search(text[max(0, operator.start() - 32) : operator.start()])
        if tower or len(digits) > 7:
            return True
        if max(len(base.group(1)), 1) * int(digits) > _MAX_POWER_DIGITS:
            return True
    return False
