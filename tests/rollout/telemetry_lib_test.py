"""Telemetry: occupancy and bubbles against a brute-force per-instance tally of random steps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.observe.trace_lib import TraceWriter
from dora_jax.rollout.telemetry_lib import Telemetry

three = lambda values: st.lists(values, min_size=3, max_size=3)  # one per instance
step = st.tuples(st.floats(0.001, 1.0), three(st.integers(0, 8)))  # (seconds, busy slots)


@settings(max_examples=50, deadline=None)
@given(st.lists(step, min_size=1, max_size=30), st.floats(0.0, 5.0), three(st.integers(1, 8)))
def test_occupancy_is_per_decoding_time_and_bubbles_count_every_wait(steps, wait, slots):
    telemetry = Telemetry(3, slots, TraceWriter("t"))
    for seconds, busy in steps:
        telemetry.decode_step([min(b, n) for b, n in zip(busy, slots, strict=True)], seconds)
    telemetry.idle_wait(wait)
    m = telemetry.iteration_metrics()

    # Brute force, instance by instance and step by step.
    filled, capacity, decoding = np.zeros(3), np.zeros(3), np.zeros(3)
    instance_steps = 0
    for seconds, busy in steps:
        for i in range(3):
            b = min(busy[i], slots[i])
            if b:
                instance_steps += 1
                filled[i] += b * seconds
                capacity[i] += slots[i] * seconds
                decoding[i] += seconds
    wall = sum(s for s, _ in steps) + wait
    for i in range(3):
        want = filled[i] / capacity[i] if capacity[i] else 0.0
        assert np.isclose(m[f"slot_occupancy/instance{i}"], want)
    assert np.isclose(m["slot_occupancy"], filled.sum() / capacity.sum() if capacity.any() else 0)
    assert np.isclose(m["bubble_fraction"], 1 - decoding.sum() / (3 * wall))
    assert m["decode_steps"] == len(steps)
    assert m["instance_steps"] == instance_steps
