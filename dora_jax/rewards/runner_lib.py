"""Scoring samples without letting one bad reward function stop the run.

A reward is user code (or math-verify on adversarial model output): it can raise, return
garbage, or hang. `RewardRunner` calls it in daemon worker threads, each call under a
wall-clock timeout. A call that raises, returns something that is not a finite number, or runs
past the timeout scores 0, is counted, and is logged with the sample id; the run goes on.

Python cannot kill a thread: a timed-out call is abandoned (its daemon thread keeps running
until the function returns, and never blocks interpreter exit). Its late result is ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
from collections.abc import Hashable, Sequence

from dora_jax.rewards.registry_lib import RewardFn

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardCounters:
    calls: int = 0
    errors: int = 0  # raised, or returned a value that is not a finite number
    timeouts: int = 0


class RewardRunner:
    """Scores `(sample_id, completion, answer)` items with `fn`, `max_workers` calls at a time."""

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0, max_workers: int = 4):
        # Thread.join refuses waits past TIMEOUT_MAX (OverflowError at the first score, long
        # after start), and NaN compares false everywhere, so every call would time out.
        if not 0 < timeout_s <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"timeout_s={timeout_s}: must be in (0, {threading.TIMEOUT_MAX:g}] seconds"
            )
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: must be >= 1")
        self._fn, self._timeout_s, self._max_workers = fn, timeout_s, max_workers
        self.counters = RewardCounters()

    def metrics(self) -> dict[str, int]:
        """Cumulative counters under TensorBoard-style names."""
        c = self.counters
        return {"reward/calls": c.calls, "reward/errors": c.errors, "reward/timeouts": c.timeouts}

    def score(self, items: Sequence[tuple[Hashable, str, str]]) -> list[float]:
        rewards: list[float] = []
        for start in range(0, len(items), self._max_workers):
            rewards.extend(self._score_chunk(items[start : start + self._max_workers]))
        return rewards

    def _score_chunk(self, items: Sequence[tuple[Hashable, str, str]]) -> list[float]:
        results: list[tuple[str, object] | None] = [None] * len(items)

        def call(i: int, completion: str, answer: str) -> None:
            try:
                results[i] = ("ok", self._fn(completion, answer))
            except Exception as e:  # any failure of user code scores 0, never stops the run
                results[i] = ("raised", e)

        threads = []
        for i, (_, completion, answer) in enumerate(items):
            thread = threading.Thread(target=call, args=(i, completion, answer), daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + self._timeout_s
        rewards = []
        for (sample_id, _, _), thread, i in zip(items, threads, range(len(items)), strict=True):
            thread.join(max(0.0, deadline - time.monotonic()))
            rewards.append(self._settle(sample_id, None if thread.is_alive() else results[i]))
        return rewards

    def _settle(self, sample_id: Hashable, result: tuple[str, object] | None) -> float:
        self.counters.calls += 1
        if result is None:
            self.counters.timeouts += 1
            _log.warning("reward for sample %s timed out after %.3gs", sample_id, self._timeout_s)
            return 0.0
        status, value = result
        if status == "raised":
            self.counters.errors += 1
            _log.warning("reward for sample %s raised %r; scoring 0", sample_id, value)
            return 0.0
        reward = _as_reward(value)
        if math.isfinite(reward):
            return reward
        self.counters.errors += 1
        _log.warning("reward for sample %s returned %r, not a finite number", sample_id, value)
        return 0.0


def _as_reward(value: object) -> float:
    """`value` as a float, NaN when it is not a real number a float can hold.

    NumPy / JAX scalars and size-1 arrays are taken through `.item()` (a reward written with
    NumPy returns `np.bool_` or a 0-d array). The conversion is user code too: a huge int or
    Fraction overflows a float, and that must score 0 like any other failure, not stop the run.
    """
    try:
        if hasattr(value, "item"):
            value = value.item()
        return float(value) if isinstance(value, numbers.Real) else math.nan
    except Exception:
        return math.nan
