"""Each paradigm's own decisions, checked after every call the loop makes to it, over random
set-ups on the doubles: what it dispatches and under which version, how much it keeps in
flight, where `partial` moves requests and what `dora` gives spare slots."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_harness import make_rollout, setups

from dora_jax.rollout import audit_lib


def _pending(rollout) -> dict[int, int]:
    return {v: len(q) for v, q in rollout.pending.items() if q}


@settings(max_examples=40, deadline=None)
@given(setup=setups(), long_dora=st.booleans())
def test_each_paradigm_dispatches_and_moves_work_by_its_own_rule(
    tmp_path_factory, setup, long_dora
):
    if long_dora:  # long enough, with room in K, for old versions' tails to take spare work
        setup.update(mode="dora", num_iterations=8, staleness_bound=4, slots=6)
    workdir = str(tmp_path_factory.mktemp("run"))
    rollout, _, _ = make_rollout(workdir, max_length=80, **setup)
    paradigm, mode = rollout.paradigm, setup["mode"]
    b = rollout.config.groups_per_batch
    top_up, rebalance, fill_spare = paradigm.top_up, paradigm.rebalance, paradigm.fill_spare

    def checked_top_up(r):
        before = collections.Counter(r.dispatched_per_version)
        top_up(r)
        added = r.dispatched_per_version - before
        assert set(added) <= {r.window.newest}, added  # new work under the newest version only
        dispatched = r.dispatched_per_version[r.window.newest]
        if mode == "sync":  # one whole batch per version
            assert dispatched in (0, b)
        elif mode == "one_step_off":  # version 0 generates the first two batches
            assert dispatched in ((0, b, 2 * b) if r.window.newest == 0 else (0, b))
        else:  # RBS samples outstanding at most
            assert not added or sum(r.outstanding().values()) <= r.rollout_batch_size

    def checked_rebalance(r, triggers):
        on_old = sum(len(x.active()) for x in r.healthy() if x.version != r.window.newest)
        reprefills = r.telemetry.counters["reprefills"]
        rebalance(r, triggers)
        if mode == "partial":  # every request goes on under the newest version, re-prefilled
            assert all(x.version == r.window.newest for x in r.healthy())
            assert r.telemetry.counters["reprefills"] - reprefills == on_old

    def checked_fill_spare(r):
        before = collections.Counter(r.dispatched_per_version)
        fill_spare(r)
        added = r.dispatched_per_version - before
        if mode != "dora":
            assert not added  # only dora gives spare slots extra work
            return
        for version in added:  # an older version's work, only where its hosts have room
            assert version != r.window.newest
            room = sum(len(x.free()) for x in r.healthy() if x.version == version)
            assert _pending(r).get(version, 0) <= room, (version, room)

    paradigm.top_up, paradigm.rebalance = checked_top_up, checked_rebalance
    paradigm.fill_spare = checked_fill_spare
    rollout.run()
    report = audit_lib.audit(workdir)
    assert report.rules["C2"] and report.rules["C3"], report.format()
