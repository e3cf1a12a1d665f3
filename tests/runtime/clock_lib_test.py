"""The logical clock against brute-force recomputations over random schedules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.runtime.clock_lib import LogicalClock


@settings(max_examples=200, deadline=None)
@given(
    timer_steps=st.integers(1, 12),
    advances=st.lists(st.integers(0, 30), min_size=1, max_size=40),
)
def test_timer_fires_once_per_multiple_reached(timer_steps, advances):
    """Brute force: the timer fires at a check iff some multiple of `timer_steps` at or before
    the tick has not fired yet (the very first check fires for tick 0)."""
    clock = LogicalClock(timer_steps, 0)
    fired_up_to = -1  # every multiple <= this has fired
    for steps in [0, *advances]:
        clock.advance(steps)
        reached = [m for m in range(0, clock.tick + 1, timer_steps) if m > fired_up_to]
        assert clock.timer_fired() == bool(reached)
        if reached:
            fired_up_to = clock.tick
        assert not clock.timer_fired()  # a second check at the same tick never fires


@settings(max_examples=200, deadline=None)
@given(
    delay=st.integers(0, 20),
    gaps=st.lists(st.integers(0, 15), min_size=1, max_size=20),
)
def test_a_version_is_due_delay_steps_after_its_batch_and_the_last_take_up(delay, gaps):
    """Batches are handed over `gap` steps apart; the loop advances one step at a time and
    takes each version up as soon as it is due. Brute force: version i is taken up at
    max(hand-over i, take-up i-1) + delay (the trainer's steps run one after another)."""
    clock = LogicalClock(1, delay)
    handed, taken, expected = [], [], []
    tick = 0
    for gap in gaps:
        tick += gap
        handed.append(tick)
    while len(taken) < len(handed):
        i = len(taken)
        if clock.tick >= handed[i] and clock.version_due(handed[i]):
            clock.took_up_version()
            taken.append(clock.tick)
            continue
        clock.advance(1)
    for h in handed:
        expected.append(max(h, expected[-1] if expected else 0) + delay)
    assert taken == expected


@settings(max_examples=100, deadline=None)
@given(
    timer_steps=st.integers(1, 8),
    delay=st.integers(0, 8),
    before=st.lists(st.tuples(st.integers(0, 9), st.booleans()), max_size=10),
    after=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=1, max_size=10),
)
def test_a_restored_clock_goes_on_as_the_original(timer_steps, delay, before, after):
    """Any history (advances, timer checks, take-ups), saved and loaded into a fresh clock:
    from then on both answer every question alike."""
    a = LogicalClock(timer_steps, delay)
    for steps, took_up in before:
        a.advance(steps)
        a.timer_fired()
        if took_up:
            a.took_up_version()
    b = LogicalClock(timer_steps, delay)
    b.load_state_dict(a.state_dict())
    for steps, handed in after:
        for clock in (a, b):
            clock.advance(steps)
        assert a.timer_fired() == b.timer_fired()
        assert a.version_due(handed) == b.version_due(handed)
        for clock in (a, b):
            clock.took_up_version()


def test_a_checkpoint_from_before_the_take_up_was_saved_loads():
    clock = LogicalClock(4, 2)
    clock.load_state_dict({"tick": 9, "timer_tick": 12})
    assert clock.version_due(7) is True and clock.version_due(8) is False


@pytest.mark.parametrize(
    "args, match",
    [((0, 1), "timer_steps must be >= 1"), ((1, -1), "publish_delay_steps >= 0")],
)
def test_bad_settings_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        LogicalClock(*args)
    with pytest.raises(ValueError, match="cannot go back"):
        LogicalClock(1, 0).advance(-1)
