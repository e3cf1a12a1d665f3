"""The orchestrator's allocation and plan, checked against brute-force invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.rollout import orchestrator_lib
from dora_jax.rollout.config_lib import RolloutConfig


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 8), work=st.dictionaries(st.integers(0, 5), st.integers(0, 50)))
def test_allocation_is_proportional_and_complete(n, work):
    dp = orchestrator_lib.allocate(n, work)
    with_work = sorted(v for v, r in work.items() if r > 0)
    if not with_work:
        assert dp == {}
        return
    assert sum(dp.values()) == n
    assert set(dp) == set(with_work[:n])  # one each, oldest first when short of instances
    assert all(d >= 1 for d in dp.values())
    total = sum(work[v] for v in dp)
    for v, d in dp.items():  # within one instance of the exact share, beyond the minimum 1
        assert d <= max(1, n * work[v] / total + len(dp))


@st.composite
def snapshots(draw):
    slots = draw(st.integers(1, 4))
    views = []
    for i in range(draw(st.integers(1, 6))):
        version = draw(st.one_of(st.none(), st.integers(0, 2)))
        busy = draw(st.integers(0, slots)) if version is not None else 0
        views.append(
            orchestrator_lib.InstanceView(i, version, tuple(range(busy)), tuple(range(busy, slots)))
        )
    return views


@settings(max_examples=300, deadline=None)
@given(views=snapshots(), data=st.data())
def test_plan_moves_requests_only_within_a_version_into_free_slots(views, data):
    work = {v: data.draw(st.integers(0, 20)) for v in range(3)}
    for view in views:  # a version with requests in slots has work
        if view.active:
            work[view.version] = max(work[view.version], len(view.active))
    targets = orchestrator_lib.allocate(len(views), work)
    plan = orchestrator_lib.plan(views, targets, staged={2})
    by_index = {v.index: v for v in views}
    used = set()
    for m in plan.migrations:
        assert by_index[m.src].version == by_index[m.dst].version
        assert m.src_slot in by_index[m.src].active and m.dst_slot in by_index[m.dst].free
        assert (m.dst, m.dst_slot) not in used
        used.add((m.dst, m.dst_slot))
    emptied = {m.src for m in plan.migrations}
    for move in plan.weight_moves:
        view = by_index[move.instance]
        # only an empty instance switches, and only to a version it does not hold
        assert not view.active or move.instance in emptied
        assert set(view.active) <= {m.src_slot for m in plan.migrations if m.src == view.index}
        assert view.version != move.version
        assert move.source is None or by_index[move.source].version == move.version
        assert move.source is not None or move.version == 2
    assert len({m.instance for m in plan.weight_moves}) == len(plan.weight_moves)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "nope"}, "rollout.mode"),
        ({"train_batch_size": 6, "group_size": 4}, "rollout.train_batch_size"),
        ({"rollout_batch_size": 4, "train_batch_size": 8}, "rollout.rollout_batch_size"),
        ({"staleness_bound": -1}, "rollout.staleness_bound"),
        ({"kv_pressure": 0.0}, "rollout.kv_pressure"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kwargs)
