"""DORA-specific behaviour on the doubles: several versions resident at once (read from the
trace), migrations without re-prefill, retired versions freed, per-iteration metrics."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from rollout_harness import make_rollout

from dora_jax.rollout import audit_lib, ledger_lib, runner_lib


def _spans_by_instance(workdir):
    with open(f"{workdir}/trace.json") as f:
        trace = json.load(f)
    names = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    spans = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"].startswith("decode v"):
            spans.setdefault(names[e["tid"]], []).append(
                (e["ts"], e["ts"] + e["dur"], e["args"]["version"])
            )
    return spans


def test_dora_runs_versions_side_by_side_and_migrates(tmp_path):
    workdir = str(tmp_path)
    rollout, trainer, engines = make_rollout(
        workdir,
        mode="dora",
        num_instances=4,
        slots=4,
        group_size=4,
        train_batch_size=8,
        rollout_batch_size=24,
        staleness_bound=2,
        num_iterations=6,
        median_length=6,
        max_length=120,
        timer_steps=4,
    )
    metrics = rollout.run()
    report = audit_lib.audit(workdir)
    assert report.passed, report.format()
    assert audit_lib.main(workdir) == 0
    # >= 2 versions decoding on different instances at the same moment, from the trace.
    spans = _spans_by_instance(workdir)
    overlap = any(
        a[0] < b[1] and b[0] < a[1] and a[2] != b[2]
        for i, j in itertools.combinations(spans, 2)
        for a in spans[i]
        for b in spans[j]
    )
    assert overlap
    assert rollout.totals["migrations"] >= 1
    assert (
        sum(m["migrations"] for m in metrics if "migrations" in m) == rollout.totals["migrations"]
    )
    assert sum(m.get("kv_bytes_moved", 0) for m in metrics) > 0
    assert report.max_staleness >= 1  # trained off-policy samples, within K
    # Retired versions are not held anywhere.
    live = set(rollout.window.live())
    assert all(x.version is None or x.version in live for x in rollout.instances)
    for m in metrics:
        assert 0 <= m["slot_occupancy"] <= 1 and 0 <= m["bubble_fraction"] <= 1
        assert m["trained_tokens_per_s"] > 0 and m["versions_live"] >= 1
    # The engine never re-prefilled: one prefill per sample start.
    assert sum(e.prefills for e in engines) == rollout.totals["prefills"]


def test_dora_fills_slots_better_than_sync(tmp_path):
    occupancy = {}
    for mode in ("sync", "dora"):
        rollout, _, _ = make_rollout(
            str(tmp_path / mode),
            mode=mode,
            num_instances=2,
            slots=4,
            group_size=4,
            train_batch_size=8,
            rollout_batch_size=24,
            staleness_bound=2,
            num_iterations=5,
            median_length=6,
            max_length=120,
        )
        rollout.run()
        occupancy[mode] = rollout.clock.tick  # logical decode steps for the same trained work
    assert occupancy["dora"] < occupancy["sync"]


def test_unstarted_work_of_an_unhosted_version_moves_to_the_newest(tmp_path):
    """Requests not started yet, bound to a version that no instance hosts, start under the
    newest version instead of waiting for an instance; a hosted version keeps its own; the
    groups' deadlines only move later (C3's admission stays valid)."""
    k = 4
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", num_instances=2, slots=4, group_size=4,
        train_batch_size=8, rollout_batch_size=64, staleness_bound=k, num_iterations=8,
    )  # fmt: skip
    rollout.load(rollout.instances[0], 0, None)  # v0 hosted; v1 hosted nowhere
    rollout.window.newest = 2
    for version in (0, 1, 1):
        rollout.dispatch_group(version)
    assert rollout.queue.due_by_deadline() == {0 + k: 1, 1 + k: 2}

    rollout.paradigm.rebalance(rollout, triggers=set())

    assert [r.key[0] for r in rollout.pending[0]] == [0] * 4
    assert not rollout.pending.get(1)
    assert sorted(r.key[0] for r in rollout.pending[2]) == [1] * 4 + [2] * 4
    assert all(r.version == 2 and not r.started for r in rollout.pending[2])
    assert rollout.queue.due_by_deadline() == {0 + k: 1, 2 + k: 2}
    assert rollout.telemetry.counters["rebound"] == 8


def test_the_trainer_gets_its_next_batch_before_the_last_version_is_taken_up(tmp_path, monkeypatch):
    """With over-provisioning a batch is often complete before the previous version is taken
    up: it goes to the trainer then (at most `TRAINER_QUEUE` batches in its hands), trained at
    its own iteration's version, and the rules still hold."""
    depths = []
    hand_over = runner_lib.Rollout._try_train

    def recording(self):
        hand_over(self)
        depths.append(len(self._jobs))

    monkeypatch.setattr(runner_lib.Rollout, "_try_train", recording)
    rollout, trainer, _ = make_rollout(
        str(tmp_path),
        mode="dora",
        group_size=2,
        train_batch_size=4,
        rollout_batch_size=16,
        staleness_bound=3,
        num_iterations=6,
        publish_delay_steps=10,
        median_length=3,
        max_length=20,
    )
    rollout.run()
    assert max(depths) == runner_lib.TRAINER_QUEUE == 2
    report = audit_lib.audit(str(tmp_path))
    assert report.passed, report.format()
    assert len(trainer.batches) == 6  # the double checked each batch's staleness at its step
    for e in ledger_lib.read(str(tmp_path)):
        if e["event"] == "train":
            assert e["trainer_version"] == e["iteration"]


def test_spare_slots_take_older_versions_work_and_the_newest_stays_within_rbs(tmp_path):
    """DESIGN's steps 1 and 5: the newest version is topped up to RBS outstanding samples, no
    more, and spare slots of instances hosting older live versions take new groups for those.
    Many slots for a small RBS: the newest version's instances have spare slots too."""
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", num_instances=3, slots=6, group_size=2, train_batch_size=4,
        rollout_batch_size=8, staleness_bound=6, num_iterations=10, median_length=6, seed=1,
    )  # fmt: skip
    after_newest, older = [], []
    dispatch = rollout.dispatch_group

    def watched(version: int) -> None:
        dispatch(version)
        if version == rollout.window.newest:
            after_newest.append(sum(rollout.outstanding().values()))
        else:
            older.append(version)

    rollout.dispatch_group = watched
    rollout.run()
    assert after_newest and max(after_newest) <= rollout.rollout_batch_size
    assert older  # the spare slots of older versions' instances did take work


def test_a_turns_finished_samples_are_scored_in_one_call_each_with_its_own_reward(tmp_path):
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", num_instances=2, slots=4, group_size=4, train_batch_size=8,
        rollout_batch_size=24, staleness_bound=2, num_iterations=4,
    )  # fmt: skip
    per_sample = rollout.reward_fn  # the harness's: response length % 2
    batches = []
    rollout.reward_fn = lambda batch: batches.append(len(batch)) or per_sample(batch)
    rollout.run()
    assert sum(batches) == rollout.totals["finished"] and max(batches) > 1
    # Rewards stay attached to their own samples: recomputed from the ledger's lengths.
    trained = [e for e in ledger_lib.read(str(tmp_path)) if e["event"] == "train"]
    assert trained and all(e["reward"] == e["response_length"] % 2 for e in trained)


def test_a_failed_migration_takes_out_its_destination_only(tmp_path):
    """When a migration's destination raised, its source kept the requests the plan had moved
    off it, and the plan's weight move then reloaded the source under them: the healthy source
    was taken out too (with two instances, the run ended with none left)."""
    for seed in range(5, 8):
        workdir = tmp_path / f"seed{seed}"
        rollout, _, engines = make_rollout(
            str(workdir), mode="dora", num_instances=2, slots=4, group_size=4,
            train_batch_size=8, rollout_batch_size=24, staleness_bound=2, num_iterations=6,
            median_length=6, max_length=120, timer_steps=4, seed=seed,
        )  # fmt: skip
        imports = []

        def unreachable(*args, imports=imports, **kwargs):
            imports.append(args)
            raise RuntimeError("injected: instance 1 cannot import a slot")

        engines[1].import_slot = unreachable
        rollout.run()
        assert imports, "no migration to instance 1 was tried: the test needs another seed"
        assert [x.index for x in rollout.healthy()] == [0]
        assert rollout.totals["failed_instances"] == 1
        report = audit_lib.audit(str(workdir))
        assert report.passed, report.format()


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
def test_the_trainers_copy_of_an_older_version_is_kept_only_while_a_load_may_need_it(
    tmp_path, mode
):
    """Each copy is a whole policy on an instance's devices. dora kept the trainer's copy of
    every live version until it retired, though once no instance holds it and no work waits
    for it nothing loads it again (work not started is moved to the newest version)."""
    rollout, _, _ = make_rollout(
        str(tmp_path), mode=mode, num_instances=4, slots=4, group_size=4, train_batch_size=8,
        rollout_batch_size=24, staleness_bound=3, num_iterations=8, median_length=6,
        max_length=120, timer_steps=4,
    )  # fmt: skip
    turn = rollout._turn

    def checked_turn():
        turn()
        held = {x.version for x in rollout.healthy()}
        for v in rollout.staged:
            if v != rollout.window.newest:
                assert v not in held and rollout.pending.get(v), (v, held)

    rollout._turn = checked_turn
    rollout.run()
    report = audit_lib.audit(str(tmp_path))
    assert report.rules["C2"] and report.rules["C3"], report.format()


def test_weight_moves_count_in_the_bubble(tmp_path, monkeypatch):
    """Engines wait while the controller moves weights: that time was counted as neither
    decoding nor idle, so a run spending most of its time in slow moves showed a small bubble.
    The instances' decoding time the metrics imply must fit in the wall time the moves left."""
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", num_instances=3, slots=4, group_size=2, train_batch_size=4,
        rollout_batch_size=12, staleness_bound=2, num_iterations=4, timer_steps=4,
    )  # fmt: skip
    moving = []
    load = runner_lib.RolloutInstance.load

    def slow_load(self, version, state):
        t0 = time.perf_counter()
        time.sleep(0.05)
        result = load(self, version, state)
        moving.append(time.perf_counter() - t0)
        return result

    monkeypatch.setattr(runner_lib.RolloutInstance, "load", slow_load)
    metrics = rollout.run()
    assert len(moving) >= 3
    wall = sum(m["iteration_time_s"] for m in metrics)
    decoding = sum((1 - m["bubble_fraction"]) * 3 * m["iteration_time_s"] for m in metrics)
    assert decoding <= 3 * (wall - sum(moving)) * 1.05 + 0.01


def test_kv_pressure_triggers_against_the_cache_each_slot_holds(tmp_path):
    """The trigger compares an instance's KV positions with what its cache holds: slots x
    `cache_length`. It used prefill room plus decode room, which the bench's and `partial`'s
    engines (prefill room for a whole response) can never fill, so it never fired there."""
    rollout, _, engines = make_rollout(
        str(tmp_path), mode="dora", num_instances=2, slots=4, group_size=2, train_batch_size=4,
        rollout_batch_size=8, staleness_bound=4, num_iterations=6, median_length=12, seed=3,
        max_length=32, kv_pressure=0.5, timer_steps=10_000,
    )  # fmt: skip
    for engine in engines:  # 8-token prompts, at most 32 tokens of response
        engine.cache_length = 40  # far below max_prefill_length + max_decode_length (1024)
    fired, expected = [], []
    rebalance = rollout.paradigm.rebalance

    def watched(r, triggers):
        fired.append("kv_pressure" in triggers)
        expected.append(
            any(
                sum(len(s.prompt.tokens) + len(s.tokens) for s in x.slots if s is not None)
                > 0.5 * len(x.slots) * x.engine.cache_length
                for x in r.healthy()
            )
        )
        rebalance(r, triggers)

    rollout.paradigm.rebalance = watched
    rollout.run()
    assert any(expected) and fired == expected


def test_older_versions_decode_while_the_controller_waits_for_the_version_it_took_up(
    tmp_path, monkeypatch
):
    """A version is taken up before the trainer's step is back: the turn enqueues the decode
    steps of instances hosting older versions, then waits for the step, and only then does
    anything run under the new version. With the same decisions, the ledger is the same on
    every run."""
    events = []
    take_up, settle = runner_lib.Rollout._take_up, runner_lib.Rollout._settle

    def taking_up(self):
        take_up(self)
        events.append(("take_up", self.window.newest))

    def settling(self):
        if self._taking_up is not None:
            events.append(("settle", self._taking_up.iteration + 1))
        return settle(self)

    monkeypatch.setattr(runner_lib.Rollout, "_take_up", taking_up)
    monkeypatch.setattr(runner_lib.Rollout, "_settle", settling)
    settings = dict(
        mode="dora", num_instances=4, slots=4, group_size=4, train_batch_size=8,
        rollout_batch_size=24, staleness_bound=2, num_iterations=6, median_length=6,
        max_length=120, timer_steps=4,
    )  # fmt: skip
    rollout, _, engines = make_rollout(str(tmp_path / "a"), **settings)
    for engine in engines:
        real = engine.generate_steps

        def decoding(params, decode_state, steps, _real=real):
            events.append(("decode", params.version))
            return _real(params, decode_state, steps)

        engine.generate_steps = decoding
    rollout.run()
    assert audit_lib.audit(str(tmp_path / "a")).passed

    overlapped = 0
    for i, (kind, version) in enumerate(events):
        if kind != "take_up":
            continue
        end = events.index(("settle", version), i)
        between = [v for k, v in events[i + 1 : end] if k == "decode"]
        assert all(v < version for v in between), (version, between)
        overlapped += bool(between)
    assert overlapped >= 3  # of 6 take-ups: the tails kept decoding through most
    make_rollout(str(tmp_path / "b"), **settings)[0].run()
    assert _ledger_text(tmp_path / "a") == _ledger_text(tmp_path / "b")


def _ledger_text(workdir) -> str:
    with open(workdir / ledger_lib.LEDGER_FILE) as f:
        return f.read()


def test_a_slow_reward_shows_as_scoring_not_as_decoding(tmp_path):
    """Scoring a turn's finished samples stalls every instance; it was counted and drawn as
    decoding, so a slow reward looked like a busy engine. It has a trace track and a metric of
    its own, and counts in the bubble."""
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", group_size=2, train_batch_size=4, rollout_batch_size=8,
        num_iterations=3, median_length=3, max_length=12,
    )  # fmt: skip
    score, calls = rollout.reward_fn, []

    def slow(batch):
        calls.append(len(batch))
        time.sleep(0.05)
        return score(batch)

    rollout.reward_fn = slow
    metrics = rollout.run()
    reward_s = sum(m.get("reward_s", 0.0) for m in metrics)
    assert reward_s >= 0.05 * len(calls) * 0.9  # the last calls may fall after the last version
    assert sum(m["rollout_time_s"] for m in metrics) < reward_s / 2  # the doubles decode fast
    assert all(m["bubble_fraction"] > 0.5 for m in metrics)
    with open(tmp_path / "trace.json") as f:
        trace = json.load(f)
    (track,) = [
        e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["args"]["name"] == "rewards"
    ]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == track]
    assert [e["args"]["samples"] for e in spans] == calls
    assert all(e["dur"] >= 50_000 for e in spans)
