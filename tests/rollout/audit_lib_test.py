"""The audit on hand-written ledgers: a clean run passes, each kind of violation is caught."""

from __future__ import annotations

import json

import pytest

from dora_jax.rollout import audit_lib


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


@pytest.mark.parametrize(
    "mutate, rule",
    [
        (lambda ev: ev.insert(-1, _train(0, 0, 0, 1)), "C2"),  # trained twice
        (lambda ev: ev[-1].update(in_flight=[]), "C2"),  # lost sample
        (lambda ev: ev.pop(), "C2"),  # no end event
        (lambda ev: ev.__setitem__(-2, _train(1, 1, 0, 0)), "C2"),  # group split over iters
        (lambda ev: ev.__setitem__(-2, _train(1, 1, -1, 1)), "C3"),  # staleness 2 > K = 1
        (lambda ev: ev.__setitem__(-2, _train(1, 1, 0, 1, first=0, last=1)), "C1"),
    ],
)
def test_each_violation_is_caught(tmp_path, mutate, rule):
    events = _clean()
    mutate(events)
    report = _write(tmp_path, events)
    assert not report.rules[rule], report.format()
    assert audit_lib.main(str(tmp_path)) == 1
