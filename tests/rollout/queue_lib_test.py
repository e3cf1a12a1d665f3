"""The trajectory queue against brute force: C3's feasibility by simulating the trainer, batch
selection earliest-deadline-first, the deadline counts after every change, and the state."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.rollout.queue_lib import TrajectoryQueue
from dora_jax.rollout.trajectory_lib import Trajectory

G = 2


def _trainable_in_time(deadlines: list[int], first_iteration: int, per_iteration: int) -> bool:
    """Trains the groups `per_iteration` at a time from `first_iteration`, earliest deadline
    first (the best any order can do), and checks none is trained after its deadline."""
    order = sorted(deadlines)
    return all(first_iteration + j // per_iteration <= d for j, d in enumerate(order))


@given(
    st.dictionaries(st.integers(0, 12), st.integers(1, 6), max_size=6),
    st.integers(0, 10),
    st.integers(1, 4),
)
def test_fits_is_whether_the_trainer_can_train_every_group_by_its_deadline(due, first, b):
    queue = TrajectoryQueue(G, staleness_bound=2, groups_per_batch=b)
    deadlines = [d for d, n in due.items() for _ in range(n)]
    assert queue.fits(due, first) == _trainable_in_time(deadlines, first, b)


def _trajectory(prompt_id: int, sample_index: int, version: int) -> Trajectory:
    return Trajectory(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=np.asarray([1], np.int32),
        response_tokens=np.asarray([2, 3], np.int32),
        behaviour_logprobs=np.zeros(2, np.float32),
        version=version,
        token_versions=np.full(2, version, np.int32),
    )


# A schedule step: ("add", how many versions behind the trainer it is bound), ("finish", which
# unfinished sample, how many versions past its bound one it ran under (a rebound sample),
# whether the rest of its group finishes with it), or ("select",).
_add = st.tuples(st.just("add"), st.integers(0, 3))
_finish = st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 1), st.booleans())
_step = st.one_of(_add, _add, _add, _finish, _finish, _finish, st.tuples(st.just("select")))


@settings(max_examples=150, deadline=None)
@given(st.lists(_step, min_size=20, max_size=100), st.integers(0, 3), st.integers(1, 3))
def test_batches_are_the_earliest_due_complete_groups_and_counts_stay_true(steps, k, b):
    queue = TrajectoryQueue(G, k, b)
    versions: dict[int, list[int]] = {}  # untrained groups: each sample's version
    done: dict[int, set[int]] = collections.defaultdict(set)
    completed: list[int] = []  # prompt ids in the order their groups completed
    iteration, next_prompt = 0, 0
    for step in steps:
        if step[0] == "add":
            version = max(iteration - step[1] % (k + 1), 0)
            queue.add_group(next_prompt, version)
            versions[next_prompt] = [version] * G
            next_prompt += 1
        elif step[0] == "finish":
            open_samples = [(p, i) for p in versions for i in range(G) if i not in done[p]]
            if not open_samples:
                continue
            p, first = open_samples[step[1] % len(open_samples)]
            for i in range(G) if step[3] else [first]:
                if i in done[p]:
                    continue
                versions[p][i] += step[2]
                queue.finish(_trajectory(p, i, versions[p][i]))
                done[p].add(i)
            if len(done[p]) == G:
                completed.append(p)
        else:
            batch = queue.select_batch(iteration)
            complete = [p for p in completed if p in versions]
            ranked = sorted(complete, key=lambda p: (min(versions[p]) + k, completed.index(p)))
            # Training the b earliest-due complete groups now must leave the rest trainable in
            # time; the queue waits exactly when it would not (or too few are complete).
            rest = [min(versions[p]) + k for p in versions if p not in ranked[:b]]
            assert (batch is not None) == (
                len(complete) >= b and _trainable_in_time(rest, iteration + 1, b)
            )
            if batch is None:
                continue
            assert [(t.prompt_id, t.sample_index) for t in batch] == [
                (p, i) for p in ranked[:b] for i in range(G)
            ]
            for p in ranked[:b]:
                del versions[p]
            iteration += 1
        want = collections.Counter(min(v) + k for v in versions.values())
        assert dict(queue.due_by_deadline()) == dict(want)

    restored = TrajectoryQueue(G, k, b)
    restored.load_state_dict(queue.state_dict())
    assert dict(restored.due_by_deadline()) == dict(queue.due_by_deadline())
    assert [(t.prompt_id, t.sample_index, t.version) for t in restored.queued()] == [
        (t.prompt_id, t.sample_index, t.version) for t in queue.queued()
    ]
