"""The audit on hand-written ledgers: a clean run passes, each kind of violation is caught."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dora_jax.rollout import audit_lib, ledger_lib


def _train(pid, idx, version, it, length=3, first=None, last=None):
    return {
        "event": "train",
        "prompt_id": pid,
        "sample_index": idx,
        "version": version,
        "first_token_version": version if first is None else first,
        "last_token_version": version if last is None else last,
        "iteration": it,
        "trainer_version": it,
        "staleness": it - version,
        "response_length": length,
        "reward": 0.0,
    }


def _clean():
    ev = [
        {
            "event": "start",
            "mode": "dora",
            "staleness_bound": 1,
            "train_batch_size": 2,
            "group_size": 2,
        }
    ]
    ev += [
        {"event": "dispatch", "prompt_id": p, "sample_index": i, "version": 0, "iteration": 0}
        for p in range(3)
        for i in range(2)
    ]
    ev += [
        _train(0, 0, 0, 0, 2),
        _train(0, 1, 0, 0, 4),
        _train(1, 0, 0, 1, 10),
        _train(1, 1, 0, 1, 6),
    ]
    ev += [
        {
            "event": "end",
            "in_flight": [[2, 0]],
            "queued": [[2, 1]],
            "queued_response_lengths": [100],
        }
    ]
    return ev


def _write(tmp_path, events):
    with open(tmp_path / "ledger.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return audit_lib.audit(str(tmp_path))


def test_clean_ledger_passes(tmp_path):
    report = _write(tmp_path, _clean())
    assert report.passed, report.format()
    assert (report.dispatched, report.trained, report.iterations) == (6, 4, 2)
    assert report.staleness_histogram == {0: 2, 1: 2}
    assert report.trained_lengths.mean == pytest.approx(5.5)
    assert report.finished_lengths.count == 5 and report.finished_lengths.mean == 24.4
    assert report.dispatched_lengths is None  # a ledger from before in-flight lengths


def test_dispatched_lengths_count_the_unfinished_at_their_length_so_far(tmp_path):
    report = _write(tmp_path, _with(_clean(), in_flight_response_lengths=[130]))
    # trained 2, 4, 10, 6; queued 100; in flight 130 so far
    assert report.dispatched_lengths == audit_lib.LengthStats(
        6, 42.0, 8.0, float(np.percentile([2, 4, 10, 6, 100, 130], 99))
    )
    assert "dispatched (unfinished: so far) samples: n=6 mean=42.0 p50=8.0" in report.format()


def _skip_iteration_1(events):
    """Iteration 1's batch trained as iteration 2 (staleness 2, within a bound of 2)."""
    events[0]["staleness_bound"] = 2
    events[-3:-1] = [_train(1, 0, 0, 2, 10), _train(1, 1, 0, 2, 6)]


@pytest.mark.parametrize(
    "mutate, rule",
    [
        (lambda ev: ev.insert(-1, _train(0, 0, 0, 1)), "C2"),  # trained twice
        (lambda ev: ev[-1].update(in_flight=[]), "C2"),  # lost sample
        (lambda ev: ev.pop(), "C2"),  # no end event
        (lambda ev: ev.__setitem__(-2, _train(1, 1, 0, 0)), "C2"),  # group split over iters
        (lambda ev: ev.__setitem__(-2, _train(1, 1, -1, 1)), "C3"),  # staleness 2 > K = 1
        (lambda ev: ev.__setitem__(-2, _train(1, 1, 0, 1, first=0, last=1)), "C1"),
        # The versions staleness is computed from must be true, not just agree with it:
        (lambda ev: ev[-2].update(trainer_version=0, staleness=0), "C3"),  # iteration 1's
        (lambda ev: ev.__setitem__(-2, _train(1, 1, 1, 1)), "C3"),  # dispatched under 0
        (_skip_iteration_1, "C3"),
    ],
)
def test_each_violation_is_caught(tmp_path, mutate, rule):
    events = _clean()
    mutate(events)
    report = _write(tmp_path, events)
    assert not report.rules[rule], report.format()
    assert audit_lib.main(str(tmp_path)) == 1


def test_a_killed_runs_ledger_fails_as_killed_without_calling_its_unfinished_samples_lost(
    tmp_path,
):
    """SIGKILL or an out-of-memory kill leaves no end event: the run did not complete, and
    what it had unfinished is not known (a resume regenerates it), so nothing is called lost."""
    events = _clean()[:-1]
    report = _write(tmp_path, events)
    assert report.rules == {"C1": True, "C2": False, "C3": True, "completed": False}
    assert report.stopped.startswith("killed")
    (line,) = report.problems["C2"]
    assert line.startswith("no end event, so the 2 dispatched samples not trained cannot be")
    assert "lost" not in report.format()
    assert "(the run did not complete: killed" in report.format().splitlines()[0]


def test_a_kill_while_an_iteration_is_written_is_said_not_called_a_short_batch(tmp_path):
    """The kill cut the last iteration's train events off: its short count and split group
    are what the kill left, not C2 / C3 failures of their own."""
    events = _clean()[:-2]  # no end event, and the last iteration has 1 of its 2 samples
    report = _write(tmp_path, events)
    assert report.rules == {"C1": True, "C2": False, "C3": True, "completed": False}
    (line,) = report.problems["C2"]
    assert "(and iteration 1's train events were cut off)" in line
    # With an end event the same short iteration is a failure.
    assert not _write(tmp_path, [*events, _clean()[-1]]).rules["C3"]


def test_clean_ledger_has_the_completed_rule_and_reads_as_before(tmp_path):
    # `_clean()` is in the format from before `stopped` / `num_iterations`: it must pass, with
    # the new rule reported and no "of N" iteration count it could not know.
    report = _write(tmp_path, _clean())
    assert report.rules == {"C1": True, "C2": True, "C3": True, "completed": True}
    assert (report.stopped, report.num_iterations) == ("completed", None)
    assert "trained in 2 iterations," in report.format()
    assert report.format().splitlines()[0] == "audit of a 'dora' run: PASS"


def _with(events, **end):
    events[-1].update(end)
    return events


def test_crashed_run_fails_prominently(tmp_path, capsys):
    events = _with(_clean(), num_iterations=2, stopped="RuntimeError: engine died")
    report = _write(tmp_path, events)
    # C1-C3 hold for what was written; the run as a whole is still not clean.
    assert report.rules == {"C1": True, "C2": True, "C3": True, "completed": False}
    assert report.problems["completed"] == [
        "the run stopped early after 2 of 2 iterations: RuntimeError: engine died"
    ]
    assert audit_lib.main(str(tmp_path)) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "audit of a 'dora' run: FAIL (the run did not complete: RuntimeError: engine died)"
    )


def test_crash_before_any_iteration_fails(tmp_path):
    # The probe's case: 0 of 2 iterations trained, nothing lost (all in flight), yet `end`.
    events = [e for e in _clean() if e["event"] != "train"]
    events[-1].update(in_flight=[[p, i] for p in range(3) for i in range(2)], queued=[])
    events[-1]["queued_response_lengths"] = []
    report = _write(tmp_path, _with(events, num_iterations=2, stopped="KeyboardInterrupt: "))
    assert report.rules["C2"] and report.rules["C3"], report.format()
    assert not report.rules["completed"] and not report.passed
    assert "0 of 2 iterations" in report.problems["completed"][0]


@pytest.mark.parametrize(
    "num_iterations, passed, problem",
    [
        (2, True, None),
        (1, True, None),  # more than asked: a resume may have asked for more
        (3, False, "the end event says completed, but 2 of 3 iterations were trained"),
    ],
)
def test_completed_run_must_train_every_iteration(tmp_path, num_iterations, passed, problem):
    events = _with(_clean(), num_iterations=num_iterations, stopped="completed")
    report = _write(tmp_path, events)
    assert report.passed == passed, report.format()
    assert report.problems["completed"] == ([] if problem is None else [problem])
    assert f"trained in 2 of {num_iterations} iterations," in report.format()


def _raw(tmp_path, text: bytes, capsys) -> str:
    (tmp_path / "ledger.jsonl").write_bytes(text)
    assert audit_lib.main(str(tmp_path)) == 1  # a clean exit code, not a traceback
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1, out
    return out


def _text(events) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events).encode()


def test_ledger_cut_off_mid_write_fails_naming_the_line(tmp_path, capsys):
    events = _clean()
    assert len(events) == 12  # the end event is line 12
    out = _raw(tmp_path, _text(events)[:-40], capsys)  # `head -c -40`: inside the end event
    assert f"{tmp_path / 'ledger.jsonl'}, line 12: the last line is cut off" in out
    assert out.startswith(f"audit of {tmp_path}: FAIL: ")


def test_ledger_cut_off_between_lines_still_audits(tmp_path):
    # Cut right after a newline the file is whole lines: the missing end event is a C2
    # failure, as before; cut right before one, the last object is whole and is kept.
    text = _text(_clean())
    (tmp_path / "ledger.jsonl").write_bytes(text[: text.rindex(b"{")])
    report = audit_lib.audit(str(tmp_path))
    assert not report.rules["C2"] and "no end event" in report.problems["C2"][0]
    (tmp_path / "ledger.jsonl").write_bytes(text[:-1])
    assert audit_lib.audit(str(tmp_path)).passed


def test_corrupt_middle_line_fails_with_its_line_and_column(tmp_path, capsys):
    lines = _text(_clean()).split(b"\n")
    lines[4] = b'{"event": "dispatch", "prompt_id": }'  # line 5
    out = _raw(tmp_path, b"\n".join(lines), capsys)
    assert "ledger.jsonl, line 5: not valid JSON (Expecting value at column 36)" in out


@pytest.mark.parametrize(
    "line, drop, message",
    [
        (8, "first_token_version", "line 8: train event lacks 'first_token_version'"),
        (1, "group_size", "line 1: start event lacks 'group_size'"),
        (12, "queued", "line 12: end event lacks 'queued'"),
        (2, "version", "line 2: dispatch event lacks 'version'"),
    ],
)
def test_event_missing_a_key_fails_naming_line_and_key(tmp_path, capsys, line, drop, message):
    events = _clean()
    del events[line - 1][drop]
    assert message in _raw(tmp_path, _text(events), capsys)


@pytest.mark.parametrize(
    "index, update, message",
    [
        (7, {"version": "0"}, "line 8: train event: 'version' is '0', expected an integer"),
        (11, {"in_flight": [[2]]}, "line 12: end event: 'in_flight' is [[2]], expected a list"),
        (11, {"stopped": None}, "line 12: end event: 'stopped' is None, expected a string"),
        (3, {"event": "trained"}, "line 4: unknown event kind 'trained'"),
    ],
)
def test_event_of_the_wrong_type_fails(tmp_path, capsys, index, update, message):
    events = _clean()
    events[index].update(update)
    assert message in _raw(tmp_path, _text(events), capsys)


def test_missing_workdir_or_ledger_fails_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert audit_lib.main(str(missing)) == 1
    assert capsys.readouterr().out == (
        f"audit of {missing}: FAIL: {missing}: no such workdir or ledger file\n"
    )
    assert audit_lib.main(str(tmp_path)) == 1  # the workdir exists, its ledger does not
    out = capsys.readouterr().out
    assert out.startswith(f"audit of {tmp_path}: FAIL: {tmp_path / 'ledger.jsonl'}: no ledger")
    (tmp_path / "ledger.jsonl").write_text("\n")  # a run killed before its start event
    assert audit_lib.main(str(tmp_path)) == 1
    assert capsys.readouterr().out == (
        f"audit of {tmp_path}: FAIL: {tmp_path / 'ledger.jsonl'} holds no events\n"
    )


def test_audit_events_rejects_a_malformed_event():
    events = _clean()
    del events[8]["staleness"]
    with pytest.raises(ledger_lib.LedgerError, match=r"^event 8: train event lacks 'staleness'$"):
        audit_lib.audit_events(events)


def test_audit_piped_into_head_ends_quietly(tmp_path):
    """`dora-jax audit DIR | head` ended in a BrokenPipeError traceback once `head` had its
    lines; a long report (here 20,000 lost samples) writes past the pipe's buffer."""
    events = _clean()
    events[-1:-1] = [
        {"event": "dispatch", "prompt_id": 10 + p, "sample_index": i, "version": 0, "iteration": 0}
        for p in range(10_000)
        for i in range(2)
    ]
    _write(tmp_path, events)
    piped = subprocess.run(
        f"{sys.executable} -m dora_jax.cli audit {tmp_path} | head -n 2",
        shell=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert piped.stdout.startswith("audit of a 'dora' run: FAIL")
    assert piped.stderr == ""
