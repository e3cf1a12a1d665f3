"""The window's admission and the queue's batch choice against brute-force restatements of C3's
deadline rule: for every deadline d, the groups due by d fit in the iterations left up to d."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.rollout.queue_lib import TrajectoryQueue
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.rollout.window_lib import VersionWindow

G = 2


def _trajectory(prompt_id: int, sample_index: int, version: int) -> Trajectory:
    return Trajectory(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=np.ones(2, np.int32),
        response_tokens=np.ones(1, np.int32),
        behaviour_logprobs=np.zeros(1, np.float32),
        version=version,
        token_versions=np.full(1, version, np.int32),
    )


def _fits(deadlines: list[int], iterations_from: int, b: int, at: list[int]) -> bool:
    """Brute force: at every deadline d of `at`, at most (d - iterations_from + 1) * b of
    `deadlines` are due."""
    return all(sum(1 for x in deadlines if x <= d) <= (d - iterations_from + 1) * b for d in at)


schedules = st.fixed_dictionaries(
    {
        "k": st.integers(0, 4),
        "b": st.integers(1, 3),
        "next_iteration": st.integers(0, 3),
        # (version, complete?) per untrained group
        "groups": st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=14),
        "version": st.integers(0, 7),
        "new_groups": st.integers(1, 4),
    }
)


def _queue(s: dict) -> TrajectoryQueue:
    queue = TrajectoryQueue(G, s["k"], s["b"])
    for prompt_id, (version, complete) in enumerate(s["groups"]):
        queue.add_group(prompt_id, version)
        for i in range(G if complete else 1):
            queue.finish(_trajectory(prompt_id, i, version))
    return queue


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_admission_is_the_deadline_rule(s):
    queue = _queue(s)
    window = VersionWindow(queue)
    window.newest = 7
    deadline = s["version"] + s["k"]
    deadlines = [min(g.versions) + s["k"] for g in queue._groups.values()]
    deadlines += [deadline] * s["new_groups"]
    expected = deadline >= s["next_iteration"] and _fits(
        deadlines, s["next_iteration"], s["b"], at=deadlines
    )
    assert window.admits(s["version"], s["next_iteration"], s["new_groups"]) == expected


@settings(max_examples=300, deadline=None)
@given(schedules)
def test_a_batch_is_taken_only_if_what_it_leaves_can_still_be_trained(s):
    queue = _queue(s)
    groups = list(queue._groups.values())
    b, k, iteration = s["b"], s["k"], s["next_iteration"]
    complete = sorted(
        (g for g in groups if g.complete), key=lambda g: (min(g.versions) + k, g.completed_seq)
    )
    chosen = complete[:b]
    left = [min(g.versions) + k for g in groups if g not in chosen]
    # Left-behind groups are trained from the next iteration on; every untrained group's
    # deadline is checked (a chosen group past its deadline fails, as it must).
    every = [min(g.versions) + k for g in groups]
    expected = len(complete) >= b and _fits(left, iteration + 1, b, at=every)
    batch = queue.select_batch(iteration)
    assert (batch is not None) == expected
    if batch is not None:
        assert {t.prompt_id for t in batch} == {g.prompt_id for g in chosen}
        assert len(batch) == b * G


operations = st.lists(
    st.tuples(st.sampled_from(["add", "rebind", "finish", "select"]), st.integers(0, 50)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4), operations)
def test_deadline_counts_follow_every_change(k, ops):
    """The queue's running count of groups per deadline equals a recount from its groups after
    any sequence of dispatches, rebinds, finishes and trained batches."""
    queue = TrajectoryQueue(G, k, 1)
    next_id, iteration = 0, 0
    for op, x in ops:
        groups = list(queue._groups.values())
        if op == "add":
            queue.add_group(next_id, x % 7)
            next_id += 1
        elif op == "rebind" and groups:
            g = groups[x % len(groups)]
            open_samples = [i for i in range(G) if i not in g.done]
            if open_samples:
                queue.rebind((g.prompt_id, open_samples[0]), g.versions[open_samples[0]] + 1)
        elif op == "finish" and groups:
            g = groups[x % len(groups)]
            open_samples = [i for i in range(G) if i not in g.done]
            if open_samples:
                queue.finish(_trajectory(g.prompt_id, open_samples[0], x % 7))
        elif op == "select" and queue.select_batch(iteration) is not None:
            iteration += 1
        recount: dict[int, int] = {}
        for g in queue._groups.values():
            recount[min(g.versions) + k] = recount.get(min(g.versions) + k, 0) + 1
        assert dict(queue.due_by_deadline()) == recount
