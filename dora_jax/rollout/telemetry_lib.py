"""Per-iteration rollout metrics and the timeline trace (one track per instance + trainer).

The two bubbles of DESIGN.md are measured apart, both weighted by wall time:

- `slot_occupancy` (1 - the intra-instance bubble): while an instance decodes, the fraction of
  its slots that hold a request. The long tail of a synchronous batch shows up here.
- `bubble_fraction` (the inter-instance bubble): the fraction of the iteration's wall time
  that instances spent not decoding. Everything else counts as idle for every instance: waiting
  for the trainer, scoring finished samples (`reward_s`; a track of its own in the trace), weight
  moves and migrations (the engines wait for them), checkpoints, the controller's own work.

Beside them, logical counts (`instance_steps`, split by how far each instance's version lags
the newest: `instance_steps/lag0`, ..., with `busy_slot_steps/` and `slot_steps/` for the
occupancy of each) say where a schedule's decode steps go, free of the host's timing noise.
"""

from __future__ import annotations

import collections
from typing import Any

from dora_jax.observe.trace_lib import TraceWriter

TRAINER_TRACK = "trainer"
REWARD_TRACK = "rewards"
# Lags from the newest version at or past this one count together: K may be large, and what
# matters is how much decoding goes to the versions well behind the newest.
LAG_BUCKETS = 3


def lag_label(lag: int) -> str:
    return f"lag{lag}" if lag < LAG_BUCKETS else f"lag{LAG_BUCKETS}+"


LAG_LABELS = tuple(lag_label(lag) for lag in range(LAG_BUCKETS + 1))


class Telemetry:
    def __init__(self, num_slots: list[int], trace: TraceWriter):
        self.trace = trace
        self.num_slots = num_slots
        self._open: dict[str, tuple[str, float, dict[str, Any]]] = {}  # track -> open span
        self.reset()

    def reset(self) -> None:
        n = len(self.num_slots)
        self.busy_slot_time = [0.0] * n
        self.busy_time = [0.0] * n
        self.rollout_time = 0.0
        self.counters: collections.Counter[str] = collections.Counter()

    # -- trace ----------------------------------------------------------------------------

    def state(self, track: str, name: str, now_us: float, **args: Any) -> None:
        """Sets `track`'s current state; consecutive identical states merge into one span."""
        current = self._open.get(track)
        if current is not None and current[0] == name and current[2] == args:
            return
        self.close(track, now_us)
        self._open[track] = (name, now_us, args)

    def close(self, track: str, now_us: float) -> None:
        current = self._open.pop(track, None)
        if current is not None:
            self.trace.span(track, current[0], current[1], now_us, **current[2])

    def action(self, track: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
        """A one-off span (prefill, migrate, load weights) that interrupts the state span."""
        self.close(track, start_us)
        self.trace.span(track, name, start_us, end_us, **args)

    def close_all(self, now_us: float) -> None:
        for track in list(self._open):
            self.close(track, now_us)

    # -- occupancy ------------------------------------------------------------------------

    def decode_turn(self, busy_per_step: list[list[int]], seconds: float, lags: list[int]) -> None:
        """One turn of decoding that took `seconds`: instance i ran `len(busy_per_step[i])`
        decode steps (none: it was idle), with `busy_per_step[i][j]` requests decoding at step
        j, hosting a version `lags[i]` behind the newest published one. The turn's time is
        shared evenly by its longest run of steps."""
        # Logical counts beside the timings: the same on any machine for the same config and
        # seed, so modes compare without the noise of a shared host. An instance's step costs
        # about the same however many of its slots are busy, so instance steps are the decode
        # cost of a schedule; split by lag they show where a multi-version schedule spends it
        # (old versions' long tails decoding on instances of their own).
        steps = max(map(len, busy_per_step), default=0)
        step_seconds = seconds / max(steps, 1)
        self.counters["decode_steps"] += steps
        self.counters["instance_steps"] += sum(map(len, busy_per_step))
        for i, busy_steps in enumerate(busy_per_step):
            lag = lag_label(lags[i])
            for busy in busy_steps:
                self.busy_slot_time[i] += busy * step_seconds
                self.busy_time[i] += step_seconds
                self.counters[f"instance_steps/{lag}"] += 1
                self.counters[f"slot_steps/{lag}"] += self.num_slots[i]
                self.counters[f"busy_slot_steps/{lag}"] += busy
        self.rollout_time += seconds

    def scored(self, samples: int, start_us: float, end_us: float) -> None:
        """A turn's finished samples were scored from `start_us` to `end_us`: a slow reward
        shows on its own track and in `reward_s`, not as decoding."""
        self.trace.span(REWARD_TRACK, f"score {samples}", start_us, end_us, samples=samples)
        self.counters["reward_s"] += (end_us - start_us) / 1e6

    def iteration_metrics(self, wall_seconds: float) -> dict[str, float]:
        """The metrics of an iteration that took `wall_seconds`, since the last `reset`."""
        n = len(self.num_slots)
        capacity = [self.num_slots[i] * self.busy_time[i] for i in range(n)]
        occupancy = [self.busy_slot_time[i] / max(capacity[i], 1e-12) for i in range(n)]
        m = {f"slot_occupancy/instance{i}": occupancy[i] for i in range(n)}
        m["slot_occupancy"] = sum(self.busy_slot_time) / max(sum(capacity), 1e-12)
        # A turn that takes up a version counts in the next iteration, its decoding before the
        # wait included: over a very short iteration that part may exceed its wall time.
        decoding = sum(self.busy_time) / (n * max(wall_seconds, 1e-12))
        m["bubble_fraction"] = max(1.0 - decoding, 0.0)
        m["rollout_time_s"] = self.rollout_time
        m.update({k: float(v) for k, v in self.counters.items()})
        return m
