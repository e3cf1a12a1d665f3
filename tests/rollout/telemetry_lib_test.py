"""Telemetry: occupancy and bubbles against a brute-force per-instance tally of random turns."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.observe.trace_lib import TraceWriter
from dora_jax.rollout.telemetry_lib import Telemetry

three = lambda values: st.lists(values, min_size=3, max_size=3)  # one per instance
# A turn: (seconds, each instance's busy slots at every decode step it ran (none: idle), lag of
# each instance's version behind the newest).
busy_steps = st.lists(st.integers(1, 8), max_size=4)
turn = st.tuples(st.floats(0.001, 1.0), three(busy_steps), three(st.integers(0, 6)))


@settings(max_examples=50, deadline=None)
@given(st.lists(turn, min_size=1, max_size=30), st.floats(0.0, 5.0), three(st.integers(1, 8)))
def test_occupancy_is_per_decoding_time_and_the_bubble_is_the_rest_of_the_wall(turns, wait, slots):
    telemetry = Telemetry(slots, TraceWriter("t"))
    for seconds, busy, lags in turns:
        capped = [[min(b, n) for b in steps] for steps, n in zip(busy, slots, strict=True)]
        telemetry.decode_turn(capped, seconds, lags)
    wall = sum(s for s, _, _ in turns) + wait  # `wait`: no instance decoding
    m = telemetry.iteration_metrics(wall)

    # Brute force, turn by turn, step by step, instance by instance: a turn's time is split
    # evenly over its longest run of steps.
    filled, capacity, decoding = np.zeros(3), np.zeros(3), np.zeros(3)
    decode_steps = instance_steps = 0
    by_lag = collections.defaultdict(lambda: np.zeros(3))  # "lag0".."lag3+": steps, busy, slots
    for seconds, busy, lags in turns:
        longest = max(len(steps) for steps in busy)
        decode_steps += longest
        for j in range(longest):
            for i in range(3):
                if j >= len(busy[i]):
                    continue
                b = min(busy[i][j], slots[i])
                instance_steps += 1
                by_lag["lag3+" if lags[i] >= 3 else f"lag{lags[i]}"] += (1, b, slots[i])
                filled[i] += b * seconds / longest
                capacity[i] += slots[i] * seconds / longest
                decoding[i] += seconds / longest
    for i in range(3):
        want = filled[i] / capacity[i] if capacity[i] else 0.0
        assert np.isclose(m[f"slot_occupancy/instance{i}"], want)
    assert np.isclose(m["slot_occupancy"], filled.sum() / capacity.sum() if capacity.any() else 0)
    assert np.isclose(m["bubble_fraction"], 1 - decoding.sum() / (3 * wall))
    assert m["decode_steps"] == decode_steps
    assert m["instance_steps"] == instance_steps
    for lag in ("lag0", "lag1", "lag2", "lag3+"):
        want_steps, want_busy, want_slots = by_lag[lag]
        assert m.get(f"instance_steps/{lag}", 0) == want_steps
        assert m.get(f"busy_slot_steps/{lag}", 0) == want_busy
        assert m.get(f"slot_steps/{lag}", 0) == want_slots
