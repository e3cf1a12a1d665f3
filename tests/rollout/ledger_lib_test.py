"""The ledger's writer and reader: what `start` / `end` write, and what `read` refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dora_jax.rollout import audit_lib, ledger_lib
from dora_jax.rollout.trajectory_lib import Trajectory


def _traj(pid: int, idx: int, version: int, length: int) -> Trajectory:
    tokens = np.arange(length, dtype=np.int32)
    return Trajectory(
        prompt_id=pid,
        sample_index=idx,
        prompt_tokens=np.zeros(2, np.int32),
        response_tokens=tokens,
        behaviour_logprobs=np.zeros(length, np.float32),
        version=version,
        token_versions=np.full(length, version, np.int32),
        reward=1.0,
    )


_DEFAULT = object()  # "pass nothing", distinct from passing None


def _run(tmp_path, *, num_iterations=_DEFAULT, stopped=_DEFAULT) -> list[dict]:
    """A run of one iteration (TBS 2, one group of 2), one sample queued at the end and two in
    flight (dispatched here only to keep the ledger whole)."""
    ledger = ledger_lib.Ledger(str(tmp_path))
    ledger.start(mode="dora", staleness_bound=1, train_batch_size=2, group_size=2)
    for pid, idx in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1)]:
        ledger.dispatch(pid, idx, version=0, iteration=0)
    for idx, length in [(0, 3), (1, 5)]:
        ledger.train(_traj(0, idx, 0, length), iteration=0, trainer_version=0)
    end_kwargs = {} if stopped is _DEFAULT else {"stopped": stopped}
    if num_iterations is not _DEFAULT:
        end_kwargs["num_iterations"] = num_iterations
    ledger.end({(2, 1): 4, (1, 1): 0}, [_traj(1, 0, 0, 7)], **end_kwargs)
    ledger.close()
    with open(tmp_path / ledger_lib.LEDGER_FILE) as f:
        return [json.loads(line) for line in f]


def test_start_and_end_write_the_new_keys(tmp_path):
    events = _run(tmp_path, num_iterations=1, stopped="ValueError: bad batch")
    assert events[0] == {
        "event": "start",
        "mode": "dora",
        "staleness_bound": 1,
        "train_batch_size": 2,
        "group_size": 2,
    }
    assert events[-1] == {
        "event": "end",
        "stopped": "ValueError: bad batch",
        "num_iterations": 1,
        "in_flight": [[1, 1], [2, 1]],  # sorted, each with its tokens so far
        "queued": [[1, 0]],
        "queued_response_lengths": [7],
        "in_flight_response_lengths": [0, 4],
    }
    assert ledger_lib.read(str(tmp_path)) == events
    report = audit_lib.audit(str(tmp_path))
    assert not report.rules["completed"] and report.stopped == "ValueError: bad batch"


def test_defaults_write_completed_and_no_num_iterations(tmp_path):
    events = _run(tmp_path, num_iterations=None)  # None, as a caller without the count passes
    assert "num_iterations" not in events[-1]
    assert events[-1]["stopped"] == "completed"
    assert audit_lib.audit(str(tmp_path)).passed


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_end_rejects_a_bad_num_iterations(tmp_path, bad):
    with pytest.raises(ValueError, match="num_iterations must be an int >= 0"):
        _run(tmp_path, num_iterations=bad)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_end_rejects_a_bad_stopped(tmp_path, bad):
    with pytest.raises(ValueError, match="stopped must be a non-empty string"):
        _run(tmp_path, stopped=bad)


def test_read_accepts_a_path_to_the_file_and_skips_blank_lines(tmp_path):
    events = _run(tmp_path)
    path = tmp_path / ledger_lib.LEDGER_FILE
    path.write_text("\n" + path.read_text().replace("\n", "\n\n"))
    assert ledger_lib.read(str(path)) == events


def test_read_rejects_non_utf8_and_non_objects(tmp_path):
    first = _run(tmp_path)[0]
    path = tmp_path / ledger_lib.LEDGER_FILE
    path.write_bytes(json.dumps(first).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ledger_lib.LedgerError, match=r"line 2: not UTF-8 text$"):
        ledger_lib.read(str(tmp_path))
    path.write_bytes(b"[1, 2]\n")
    with pytest.raises(ledger_lib.LedgerError, match=r"line 1: not a JSON object: \[1, 2\]$"):
        ledger_lib.read(str(tmp_path))


@pytest.mark.parametrize(
    "keys, lengths",
    [("queued", "queued_response_lengths"), ("in_flight", "in_flight_response_lengths")],
)
def test_read_rejects_lengths_that_do_not_match_their_samples(tmp_path, keys, lengths):
    events = _run(tmp_path)
    events[-1][lengths].append(3)
    (tmp_path / ledger_lib.LEDGER_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    n = len(events[-1][keys])
    with pytest.raises(ledger_lib.LedgerError, match=f"{n + 1} {lengths} for {n} {keys}"):
        ledger_lib.read(str(tmp_path))
