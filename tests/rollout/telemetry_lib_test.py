"""Telemetry: occupancy and bubbles against a brute-force per-instance tally of random steps."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.observe.trace_lib import TraceWriter
from dora_jax.rollout.telemetry_lib import Telemetry

three = lambda values: st.lists(values, min_size=3, max_size=3)  # one per instance
# (seconds, busy slots, lag of each instance's version behind the newest)
step = st.tuples(st.floats(0.001, 1.0), three(st.integers(0, 8)), three(st.integers(0, 6)))


@settings(max_examples=50, deadline=None)
@given(st.lists(step, min_size=1, max_size=30), st.floats(0.0, 5.0), three(st.integers(1, 8)))
def test_occupancy_is_per_decoding_time_and_bubbles_count_every_wait(steps, wait, slots):
    telemetry = Telemetry(3, slots, TraceWriter("t"))
    for seconds, busy, lags in steps:
        telemetry.decode_step([min(b, n) for b, n in zip(busy, slots, strict=True)], seconds, lags)
    telemetry.idle_wait(wait)
    m = telemetry.iteration_metrics()

    # Brute force, instance by instance and step by step.
    filled, capacity, decoding = np.zeros(3), np.zeros(3), np.zeros(3)
    instance_steps = 0
    by_lag = collections.defaultdict(lambda: np.zeros(3))  # "lag0".."lag3+": steps, busy, slots
    for seconds, busy, lags in steps:
        for i in range(3):
            b = min(busy[i], slots[i])
            if b:
                instance_steps += 1
                by_lag["lag3+" if lags[i] >= 3 else f"lag{lags[i]}"] += (1, b, slots[i])
                filled[i] += b * seconds
                capacity[i] += slots[i] * seconds
                decoding[i] += seconds
    wall = sum(s for s, _, _ in steps) + wait
    for i in range(3):
        want = filled[i] / capacity[i] if capacity[i] else 0.0
        assert np.isclose(m[f"slot_occupancy/instance{i}"], want)
    assert np.isclose(m["slot_occupancy"], filled.sum() / capacity.sum() if capacity.any() else 0)
    assert np.isclose(m["bubble_fraction"], 1 - decoding.sum() / (3 * wall))
    assert m["decode_steps"] == len(steps)
    assert m["instance_steps"] == instance_steps
    for lag in ("lag0", "lag1", "lag2", "lag3+"):
        want_steps, want_busy, want_slots = by_lag[lag]
        assert m.get(f"instance_steps/{lag}", 0) == want_steps
        assert m.get(f"busy_slot_steps/{lag}", 0) == want_busy
        assert m.get(f"slot_steps/{lag}", 0) == want_slots
