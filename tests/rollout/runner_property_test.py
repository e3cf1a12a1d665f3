"""Property tests of the whole rollout loop on the engine/trainer doubles.

References are independent of the runtime's books: the audit re-reads the ledger, the engine
double's log-probs encode the version of the params that really sampled each token, and its
tokens are a pure function of (seed, index), so a migrated request must match the reference
sequence exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_doubles import token_at, version_of
from rollout_harness import MODES, double_text, make_rollout, setups

from dora_jax.rollout import audit_lib, ledger_lib, telemetry_lib


def _trained(trainer):
    return [t for batch in trainer.batches for t in batch]


def _assert_every_sample_is_somewhere_once(rollout, trainer, workdir):
    """C2 from books the audit does not read: each dispatched sample was trained once (the
    trainer's own batches), or is in a live instance's slot, pending, or finished and queued,
    and in exactly one of these. The audit trusts the end event's in-flight list; this does
    not."""
    trained = collections.Counter(t.key for t in _trained(trainer))
    assert max(trained.values(), default=1) == 1, trained.most_common(3)
    in_slots = {r.key for x in rollout.healthy() for r in x.slots if r is not None}
    pending = {r.key for q in rollout.pending.values() for r in q}
    queued = {t.key for t in rollout.queue.queued()}
    events = ledger_lib.read(workdir)
    for key in {(e["prompt_id"], e["sample_index"]) for e in events if e["event"] == "dispatch"}:
        places = (key in trained) + (key in in_slots) + (key in pending) + (key in queued)
        assert places == 1, (key, key in trained, key in in_slots, key in pending, key in queued)


def _has(stop_strings: tuple[str, ...], text: list[str]) -> bool:
    return any(s in "".join(text) for s in stop_strings)


PROPS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPS
@given(setup=setups())
def test_every_mode_terminates_and_keeps_the_rules(tmp_path_factory, setup):
    workdir = str(tmp_path_factory.mktemp("run"))
    rollout, trainer, _ = make_rollout(workdir, max_length=60, **setup)
    metrics = rollout.run()
    report = audit_lib.audit(workdir)
    assert len(metrics) == setup["num_iterations"] == report.iterations
    assert report.rules["C2"], report.format()
    assert report.rules["C3"], report.format()
    trained = _trained(trainer)
    # C1, from the double's log-probs (the version of the params that really sampled a token).
    sampled_by = [{version_of(lp) for lp in t.behaviour_logprobs} for t in trained]
    for t, versions in zip(trained, sampled_by, strict=True):
        assert versions == set(t.token_versions.tolist())
    mixed = sum(len(v) > 1 for v in sampled_by)
    assert report.c1_violations == mixed
    if setup["mode"] != "partial":
        assert report.rules["C1"] and mixed == 0
        # No re-prefill anywhere: every response is exactly the reference token sequence.
        for t in trained:
            seed = rollout.seed_of(t.prompt_id, t.sample_index)
            ref = [token_at(seed, i) for i in range(len(t.response_tokens))]
            assert t.response_tokens.tolist() == ref
    for t in trained:  # a stop string ends a response at its first match, and only there
        text = [double_text(x) for x in t.response_tokens.tolist()]
        ends = [n for n in range(1, len(text) + 1) if _has(setup["stop_strings"], text[:n])]
        limit = rollout.prompts(t.prompt_id).max_new_tokens[t.sample_index]
        if ends:
            assert ends[0] == len(text) and not t.truncated
        else:
            assert len(text) == limit and t.truncated
    _assert_every_sample_is_somewhere_once(rollout, trainer, workdir)
    # The audit agrees with the runtime's and the trainer's own counters.
    assert report.trained == rollout.totals["trained"] == len(trained)
    assert report.in_flight_at_end == len(rollout.unfinished)
    assert report.queued_at_end == len(rollout.queue.queued())
    assert report.dispatched == report.trained + report.in_flight_at_end + report.queued_at_end
    hist = collections.Counter(
        i - t.version for i, batch in enumerate(trainer.batches) for t in batch
    )
    assert report.staleness_histogram == dict(hist)
    assert report.max_staleness <= rollout.queue.k
    # |W| <= K + 1 at every iteration.
    assert all(m["versions_live"] <= rollout.queue.k + 1 for m in metrics)
    if setup["mode"] == "one_step_off":
        assert {s for s, n in hist.items() if n} <= {0, 1}
        assert all(i - t.version == 1 for i, b in enumerate(trainer.batches) if i for t in b)
    if setup["mode"] == "sync":
        assert set(hist) == {0}
    # An instance never decodes a version further behind the newest than the mode's bound lets
    # its samples be trained: sync and partial (every instance reloads at each update) decode
    # the newest only, one_step_off at most one behind, dora at most K.
    bound = {"sync": 0, "partial": 0, "one_step_off": 1, "dora": rollout.queue.k}[setup["mode"]]
    steps = collections.Counter()
    for m in metrics:
        steps.update({k: v for k, v in m.items() if k.startswith("instance_steps/")})
    allowed = {telemetry_lib.lag_label(lag) for lag in range(bound + 1)}
    assert sum(steps[f"instance_steps/{lag}"] for lag in allowed) == sum(steps.values())
    assert sum(steps.values()) == sum(m.get("instance_steps", 0) for m in metrics)


@settings(max_examples=15, deadline=None)
@given(setup=setups())
def test_same_seed_gives_the_same_ledger(tmp_path_factory, setup):
    ledgers = []
    for _ in range(2):
        workdir = str(tmp_path_factory.mktemp("run"))
        make_rollout(workdir, max_length=60, **setup)[0].run()
        with open(f"{workdir}/{ledger_lib.LEDGER_FILE}") as f:
            ledgers.append(f.read())
    assert ledgers[0] == ledgers[1]


@settings(max_examples=30, deadline=None)
@given(
    setup=setups(),
    fail_at=st.integers(1, 30),
    stage=st.sampled_from(["decode", "decode read-back", "prefill read-back", "stop strings"]),
)
def test_failed_instance_requests_are_regenerated(tmp_path_factory, setup, fail_at, stage):
    setup["num_instances"] = max(setup["num_instances"], 2)
    workdir = str(tmp_path_factory.mktemp("run"))
    texts = itertools.count(1)

    def text_of(token):  # the `fail_at`-th token read anywhere raises, once
        if next(texts) == fail_at:
            raise RuntimeError("the stop strings' text stream failed")
        return double_text(token)

    if stage.startswith("decode"):
        fail = {"fail": {0: fail_at}, "fail_on_readback": stage == "decode read-back"}
    elif stage == "stop strings":  # an error while an instance's read-back is being recorded
        fail = {"text_stream": lambda: text_of}
        setup["stop_strings"] = setup["stop_strings"] or ("abc",)
    else:
        fail = {"fail_prefill": {0: fail_at}}
    rollout, trainer, engines = make_rollout(workdir, max_length=60, **fail, **setup)
    rollout.run()
    report = audit_lib.audit(workdir)
    assert report.rules["C2"] and report.rules["C3"], report.format()
    _assert_every_sample_is_somewhere_once(rollout, trainer, workdir)
    if stage == "stop strings":
        assert rollout.totals["failed_instances"] == (next(texts) > fail_at)  # it raised
        return
    calls = engines[0].steps if stage.startswith("decode") else engines[0].prefill_calls
    if calls > fail_at:  # the failure happened
        assert rollout.totals["failed_instances"] == 1
        assert not rollout.instances[0].healthy
        events = ledger_lib.read(workdir)
        counts = collections.Counter(
            (e["prompt_id"], e["sample_index"]) for e in events if e["event"] == "dispatch"
        )
        # A requeued sample is dispatched again when it restarts; one the run ended before
        # restarting is still pending (and listed as in flight by the end event).
        waiting = sum(1 for q in rollout.pending.values() for r in q if counts[r.key])
        assert sum(n - 1 for n in counts.values()) + waiting == rollout.totals["requeued"]


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
def test_an_admission_that_raises_at_dispatch_does_not_stall_the_run(tmp_path, mode):
    """A dead generation host raises on its first call. When the turn's whole admission went
    to it, the turn made no progress by the stall detector's count (no prefill, no batch)
    although the other instance could take the requeued work next turn: the run ended with
    "rollout stalled"."""
    workdir = str(tmp_path)
    rollout, trainer, engines = make_rollout(
        workdir, mode=mode, num_instances=2, slots=4, group_size=4, train_batch_size=4,
        rollout_batch_size=4, staleness_bound=1, num_iterations=3,
    )  # fmt: skip
    admit = engines[0].admit

    def dead_on_first_call(*args, **kwargs):
        if engines[0].prefill_calls == 0:
            raise RuntimeError("injected: generation host unreachable")
        return admit(*args, **kwargs)

    engines[0].admit = dead_on_first_call
    rollout.run()
    assert rollout.totals["failed_instances"] == 1 and not rollout.instances[0].healthy
    report = audit_lib.audit(workdir)
    assert report.rules["C2"] and report.rules["C3"], report.format()
    assert sum(e["event"] == "train" for e in ledger_lib.read(workdir)) == 3 * 4
    _assert_every_sample_is_somewhere_once(rollout, trainer, workdir)


def test_an_interrupt_waits_for_the_running_training_step_only(tmp_path):
    """Ctrl-C waited for the step queued behind the running one too: up to two training steps,
    minutes each on a large model, though nothing keeps the second step's result."""
    workdir = str(tmp_path)
    rollout, trainer, _ = make_rollout(
        workdir, mode="dora", group_size=2, train_batch_size=4, rollout_batch_size=16,
        staleness_bound=4, num_iterations=6, publish_delay_steps=10_000,
    )  # fmt: skip
    step = trainer.step

    def slow_step(batch):
        time.sleep(0.5)
        return step(batch)

    trainer.step = slow_step
    score = rollout.reward_fn

    def interrupt_once_two_steps_are_handed_over(batch):
        if len(rollout._jobs) == 2:
            raise KeyboardInterrupt
        return score(batch)

    rollout.reward_fn = interrupt_once_two_steps_are_handed_over
    with pytest.raises(KeyboardInterrupt):
        rollout.run()
    assert len(trainer.batches) == 1  # the second step never started
    end = ledger_lib.read(workdir)[-1]
    assert end["stopped"] == "KeyboardInterrupt (interrupted)"
    report = audit_lib.audit(workdir)
    assert report.rules["C2"], report.format()  # both batches listed as queued: none lost


def test_partial_breaks_c1_when_an_update_lands_mid_trajectory(tmp_path):
    rollout, trainer, _ = make_rollout(
        str(tmp_path),
        mode="partial",
        train_batch_size=4,
        rollout_batch_size=12,
        group_size=2,
        staleness_bound=2,
        num_iterations=4,
        median_length=8,
    )
    rollout.run()
    report = audit_lib.audit(str(tmp_path))
    assert not report.rules["C1"] and report.c1_violations > 0
    assert report.rules["C2"] and report.rules["C3"]
    assert audit_lib.main(str(tmp_path)) == 1
    mixed = [t for t in _trained(trainer) if len(set(t.token_versions.tolist())) > 1]
    assert len(mixed) == report.c1_violations
    for t in mixed:  # the re-prefilled tail really came from the newer params
        assert [version_of(lp) for lp in t.behaviour_logprobs] == t.token_versions.tolist()


@pytest.mark.parametrize("mode", MODES)
def test_length_bias_is_reported_against_numpy(tmp_path, mode):
    rollout, trainer, _ = make_rollout(
        str(tmp_path),
        mode=mode,
        train_batch_size=4,
        rollout_batch_size=8,
        group_size=2,
        num_iterations=3,
    )
    rollout.run()
    report = audit_lib.audit(str(tmp_path))
    lengths = [len(t.response_tokens) for t in _trained(trainer)]
    assert report.trained_lengths.mean == pytest.approx(np.mean(lengths))
    assert report.trained_lengths.p99 == pytest.approx(np.percentile(lengths, 99))
    finished = lengths + [len(t.response_tokens) for t in rollout.queue.queued()]
    assert report.finished_lengths.p50 == pytest.approx(np.percentile(finished, 50))
    dispatched = finished + [len(r.tokens) for r in rollout.unfinished.values()]
    assert report.dispatched_lengths.count == len(dispatched) == report.dispatched
    assert report.dispatched_lengths.mean == pytest.approx(np.mean(dispatched))


def test_a_prefill_that_fails_half_way_requeues_each_request_once(tmp_path):
    """Two length buckets make two engine calls; the second fails on read-back (as a device
    error surfaces in JAX, here with the turn's decode step) after the first batch's tokens
    were read."""
    rollout, _, engines = make_rollout(
        str(tmp_path), num_instances=2, slots=4, group_size=2, train_batch_size=2,
        rollout_batch_size=4, num_iterations=2, max_length=80, median_length=40, seed=3,
    )  # fmt: skip
    x = rollout.instances[0]
    rollout.load(x, 0, None)
    rollout.dispatch_group(0)
    short, long = rollout.pending[0].popleft(), rollout.pending[0].popleft()
    long.tokens = [1] * 20  # as if re-prefilled after 20 tokens: a larger bucket
    assert long.max_new_tokens > 21 and x.engine.bucket_for(8) != x.engine.bucket_for(28)
    engines[0].fail_after_prefills = engines[0].prefill_calls + 1
    rollout.start([(x, [(short, 0), (long, 1)])])
    rollout._decode()
    assert not x.healthy
    requeued = [r.key for q in rollout.pending.values() for r in q]
    assert sorted(requeued) == sorted([short.key, long.key])
    assert rollout.totals["requeued"] == 2
    assert all(not r.started and not r.tokens for q in rollout.pending.values() for r in q)


def test_a_read_back_that_fails_after_a_request_finished_loses_nothing(tmp_path):
    """A request that finished with its first token (read back with the turn's admissions),
    then a decode step whose read-back fails (a device error, a generation host gone): the
    instance is out and both requests are requeued, the finished one too (the turn's tokens
    are untrusted). It used to leave its slot before the error and end up in no book at all,
    while the ledger's end event still listed it as in flight."""
    rollout, _, engines = make_rollout(
        str(tmp_path), num_instances=2, slots=4, group_size=2, train_batch_size=2,
        rollout_batch_size=4, num_iterations=2, fail_on_readback=True,
    )  # fmt: skip
    x = rollout.instances[0]
    rollout.load(x, 0, None)
    rollout.dispatch_group(0)
    one_token, longer = rollout.pending[0].popleft(), rollout.pending[0].popleft()
    prompt = dataclasses.replace(one_token.prompt, max_new_tokens=(1, 30))
    one_token.prompt = longer.prompt = prompt
    engines[0].fail_after_steps = engines[0].steps  # the turn's decode step fails on read-back
    rollout.start([(x, [(one_token, 0), (longer, 1)])])
    rollout._decode()
    assert not x.healthy
    requeued = [r.key for q in rollout.pending.values() for r in q]
    assert sorted(requeued) == sorted([one_token.key, longer.key])
    assert rollout.totals["requeued"] == 2 and rollout.totals["finished"] == 0


def _raise_after(owner, method: str, calls: int) -> None:
    """Makes `owner.method` raise from its `calls + 1`-th call on, as a dead generation host's
    `RemoteEngine` does (`HostError`) on any call."""
    real, seen = getattr(owner, method), []

    def wrapped(*args, **kwargs):
        seen.append(1)
        if len(seen) > calls:
            raise RuntimeError(f"injected {method} failure")
        return real(*args, **kwargs)

    setattr(owner, method, wrapped)


@pytest.mark.parametrize(
    "mode, method, calls",
    [
        ("dora", "export_slot", 0),  # a migration's source
        ("dora", "export_slot", 1),
        ("dora", "import_slot", 0),  # its destination: the request already left the source
        ("dora", "import_slot", 1),
        # A weight move: the params' placement on the instance (`load`, or `receive` for the
        # version taken up in the turn).
        ("dora", "_place", 1),
        ("partial", "free_slot", 0),  # interrupting the in-flight requests at an update
        ("partial", "free_slot", 2),
        ("partial", "_place", 1),
    ],
)
def test_an_engine_error_outside_decoding_takes_out_the_instance_and_loses_nothing(
    tmp_path, mode, method, calls
):
    """Migrations, weight moves and interruptions reach the engine too (a generation host's
    connection can end in any call); each error takes that instance out and requeues its
    requests, and the run goes on. Three of the four instances fail that way."""
    rollout, trainer, engines = make_rollout(
        str(tmp_path), mode=mode, num_instances=4, slots=4, group_size=4, train_batch_size=8,
        rollout_batch_size=24, staleness_bound=2, num_iterations=6, median_length=6,
        max_length=120, timer_steps=4, seed=0,
    )  # fmt: skip
    for i in range(3):
        owner = rollout.instances[i] if method == "_place" else engines[i]
        _raise_after(owner, method, calls)
    rollout.run()
    assert rollout.totals["failed_instances"] >= 1
    report = audit_lib.audit(str(tmp_path))
    assert report.rules["C2"] and report.rules["C3"], report.format()
    _assert_every_sample_is_somewhere_once(rollout, trainer, str(tmp_path))


def test_a_run_stopped_mid_decode_lists_each_unfinished_sample_with_its_length_so_far(tmp_path):
    """The audit's dispatched lengths count what a stopped run cut off at its length so far."""
    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", group_size=2, train_batch_size=4, rollout_batch_size=16,
        num_iterations=5,
    )  # fmt: skip
    calls, score = itertools.count(), rollout.reward_fn

    def failing(batch):
        if next(calls) == 6:
            raise RuntimeError("injected reward failure")
        return score(batch)

    rollout.reward_fn = failing
    with pytest.raises(RuntimeError, match="injected reward failure"):
        rollout.run()
    end = ledger_lib.read(str(tmp_path))[-1]
    keys = sorted(rollout.unfinished)
    lengths = [len(rollout.unfinished[k].tokens) for k in keys]
    assert end["in_flight"] == [list(k) for k in keys]
    assert end["in_flight_response_lengths"] == lengths
    partial = [n for k, n in zip(keys, lengths, strict=True)
               if 0 < n < rollout.unfinished[k].max_new_tokens]  # fmt: skip
    assert partial, lengths  # some were cut off mid-decode
    report = audit_lib.audit(str(tmp_path))
    assert report.rules["C2"], report.format()
    assert report.dispatched_lengths.count == report.dispatched


@pytest.mark.parametrize("mode", ["dora", "sync"])
def test_a_training_step_that_raises_leaves_its_batch_untrained_in_the_ledger(tmp_path, mode):
    """The ledger writes a sample as trained once its step is done: when the trainer raises
    (a NaN loss under the `stop` policy, say), the run stops, and its batch (with the one
    queued behind it) is listed at the end as queued, so the audit of the stopped run still
    finds every sample somewhere and claims none the trainer never took."""
    rollout, trainer, _ = make_rollout(
        str(tmp_path), mode=mode, group_size=2, train_batch_size=4, rollout_batch_size=8,
        num_iterations=5, publish_delay_steps=3,
    )  # fmt: skip
    _raise_after(trainer, "step", 2)
    with pytest.raises(RuntimeError, match="injected step failure"):
        rollout.run()
    events = ledger_lib.read(str(tmp_path))
    trained = [(e["prompt_id"], e["sample_index"]) for e in events if e["event"] == "train"]
    assert sorted(trained) == sorted(t.key for t in _trained(trainer))
    assert {e["iteration"] for e in events if e["event"] == "train"} == {0, 1}
    report = audit_lib.audit(str(tmp_path))
    assert report.rules["C2"], report.format()
    assert report.queued_at_end >= 4  # at least the batch whose step raised
    # Nothing lost, and still no clean run: the end event says how it stopped.
    assert not report.passed and report.stopped == "RuntimeError: injected step failure"
    assert report.num_iterations == 5
