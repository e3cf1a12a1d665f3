"""Splitting the host's cores between the trainer and rollout, and pinning this process."""

from __future__ import annotations

import os
import threading

import pytest

from dora_jax.runtime import cpu_cores_lib

ALLOWED = frozenset(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin apart")


@needs_two_cores
def test_split_gives_the_trainer_the_highest_cores_and_rollout_the_rest():
    train, rollout = cpu_cores_lib.split(1)
    assert train == {max(ALLOWED)}
    assert rollout == ALLOWED - train


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, len(ALLOWED), len(ALLOWED) + 3])
def test_a_split_that_leaves_nothing_or_is_not_a_count_names_the_field(bad):
    with pytest.raises(ValueError, match=r"runtime\.train_cpu_cores"):
        cpu_cores_lib.split(bad)


def _thread_affinities() -> dict[int, frozenset[int]]:
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


@needs_two_cores
def test_pinned_moves_every_thread_and_threads_it_starts_then_restores_them():
    core = min(ALLOWED)
    stop, seen = threading.Event(), {}
    before = threading.Thread(target=stop.wait)  # started before pinning
    before.start()
    try:
        with cpu_cores_lib.pinned(frozenset({core})):
            assert set(_thread_affinities().values()) == {frozenset({core})}

            def record() -> None:
                seen["affinity"] = os.sched_getaffinity(0)

            started = threading.Thread(target=record)
            started.start()
            started.join()
            assert seen["affinity"] == {core}
            assert os.sched_getaffinity(before.native_id) == {core}
        assert set(_thread_affinities().values()) == {ALLOWED}
    finally:
        stop.set()
        before.join()
