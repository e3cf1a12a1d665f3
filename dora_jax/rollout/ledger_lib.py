"""The run ledger, `WORKDIR/ledger.jsonl`: one JSON object per line, the audit's only input.

Events: `start` (the bounds the audit checks against, so it needs nothing but the
file), `dispatch` when a sample starts decoding (again, with the same key, when a failed
instance's sample is regenerated), `train` when a sample is trained (its step done, the new
version taken up), `end` when the run stops with how it stopped (`"completed"`, or the error
that ended it: the runner writes `end` on the way out of a crash too), the iterations it was
asked for, what was still in flight (with its response length so far) and what sat finished,
untrained (in the trajectory
queue, or handed to a trainer that did not finish its step). Lines are written in
the orchestrator's logical order, so the same config and seed give a byte-identical file.

`read` accepts only what `Ledger` writes: a missing file, a line that is not JSON (the last
one cut off by a crash mid-write, say) or an event without a key the audit reads raises
`LedgerError` naming the file and line, so no ledger is audited in part. Ledgers from before
`end.stopped`, `end.num_iterations` and the end's response lengths existed read as they
always did.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from dora_jax.config_fields_lib import as_integer
from dora_jax.rollout.trajectory_lib import Trajectory

LEDGER_FILE = "ledger.jsonl"
COMPLETED = "completed"  # `end.stopped` of a run that trained every iteration it was asked for


class LedgerError(ValueError):
    """A ledger that cannot be audited: missing, cut off, or not in the format `Ledger` writes."""


class Ledger:
    """Appends events to `workdir/ledger.jsonl`.

    A new run truncates any earlier file. A resumed run cuts the file back to the byte
    offset its checkpoint recorded: events written after that checkpoint describe work the
    resumed run redoes, and keeping them would count those samples twice.
    """

    def __init__(self, workdir: str, resume_offset: int | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, LEDGER_FILE)
        if resume_offset is None:
            self._file = open(self.path, "w")  # noqa: SIM115 - held for the run's lifetime
        else:
            self._file = open(self.path, "r+")  # noqa: SIM115
            self._file.truncate(resume_offset)
            self._file.seek(resume_offset)

    def offset(self) -> int:
        """Bytes written so far, flushed: where a resumed run continues."""
        self._file.flush()
        return self._file.tell()

    def _write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event) + "\n")

    def start(
        self, *, mode: str, staleness_bound: int, train_batch_size: int, group_size: int
    ) -> None:
        self._write(
            {
                "event": "start",
                "mode": mode,
                "staleness_bound": staleness_bound,
                "train_batch_size": train_batch_size,
                "group_size": group_size,
            }
        )

    def dispatch(self, prompt_id: int, sample_index: int, version: int, iteration: int) -> None:
        self._write(
            {
                "event": "dispatch",
                "prompt_id": prompt_id,
                "sample_index": sample_index,
                "version": version,
                "iteration": iteration,
            }
        )

    def train(self, traj: Trajectory, *, iteration: int, trainer_version: int) -> None:
        self._write(
            {
                "event": "train",
                "prompt_id": traj.prompt_id,
                "sample_index": traj.sample_index,
                "version": traj.version,
                "first_token_version": traj.first_token_version,
                "last_token_version": traj.last_token_version,
                "iteration": iteration,
                "trainer_version": trainer_version,
                "staleness": trainer_version - traj.version,
                "response_length": len(traj.response_tokens),
                "reward": float(traj.reward),
            }
        )

    def end(
        self,
        in_flight: Mapping[tuple[int, int], int],
        queued: list[Trajectory],
        *,
        stopped: str = COMPLETED,
        num_iterations: int | None = None,
    ) -> None:
        """`in_flight`: every dispatched, unfinished sample's key -> the response tokens it has
        so far. `stopped`: `COMPLETED`, or what ended the run (e.g. the exception's type and
        message). `num_iterations`: what the run was asked for, so the audit can tell a run that
        trained all of it from one cut short; here, not in `start`, because a resumed run may
        be asked for more (or fewer) than the run it continues. Left out when None."""
        if not isinstance(stopped, str) or not stopped:
            raise ValueError(f"stopped must be a non-empty string, got {stopped!r}")
        event: dict[str, Any] = {"event": "end", "stopped": stopped}
        if num_iterations is not None:
            if not _int(num_iterations) or num_iterations < 0:
                raise ValueError(f"num_iterations must be an int >= 0, got {num_iterations!r}")
            event["num_iterations"] = num_iterations
        keys = sorted(in_flight)
        event["in_flight"] = [list(k) for k in keys]
        event["queued"] = [list(t.key) for t in queued]
        # For the audit's length bias: the finished-but-untrained samples' lengths, and the
        # unfinished ones' so far (a lower bound: the tail a run cut off is what it would hide).
        event["queued_response_lengths"] = [len(t.response_tokens) for t in queued]
        event["in_flight_response_lengths"] = [in_flight[k] for k in keys]
        self._write(event)

    def close(self) -> None:
        self._file.close()


# -- reading --------------------------------------------------------------------------------


def _int(v: Any) -> bool:
    return as_integer(v) is not None  # JSON true is no sample id


def _keys(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(k, list) and len(k) == 2 and all(_int(x) for x in k) for k in v
    )


_Field = tuple[Callable[[Any], bool], str]
_INT: _Field = (_int, "an integer")
_STR: _Field = (lambda v: isinstance(v, str), "a string")
_NUM: _Field = (lambda v: _int(v) or isinstance(v, float), "a number")
_KEYS: _Field = (_keys, "a list of [prompt_id, sample_index] pairs")
_INTS: _Field = (lambda v: isinstance(v, list) and all(_int(x) for x in v), "a list of integers")
_IDS = {"prompt_id": _INT, "sample_index": _INT, "version": _INT, "iteration": _INT}

# Every key the audit reads, per event kind. Checked up front so that a malformed ledger is a
# clear error at its line, not a KeyError or TypeError deep inside the audit.
_REQUIRED: dict[str, dict[str, _Field]] = {
    "start": {"mode": _STR, "staleness_bound": _INT, "train_batch_size": _INT, "group_size": _INT},
    "dispatch": _IDS,
    "train": _IDS
    | {
        "first_token_version": _INT,
        "last_token_version": _INT,
        "trainer_version": _INT,
        "staleness": _INT,
        "response_length": _INT,
        "reward": _NUM,
    },
    "end": {"in_flight": _KEYS, "queued": _KEYS},
}
# Keys that older ledgers lack: checked only when present.
_OPTIONAL: dict[str, dict[str, _Field]] = {
    "end": {
        "stopped": _STR,
        "num_iterations": _INT,
        "queued_response_lengths": _INTS,
        "in_flight_response_lengths": _INTS,
    },
}

# Lists that give one value per sample of another list of the same event.
_PARALLEL: dict[str, tuple[tuple[str, str], ...]] = {
    "end": (("queued", "queued_response_lengths"), ("in_flight", "in_flight_response_lengths")),
}


def check_event(event: Any) -> None:
    """Raises `LedgerError` unless `event` has every key the audit reads, each of its type."""
    if not isinstance(event, dict):
        raise LedgerError(f"not a JSON object: {event!r:.80}")
    kind = event.get("event")
    if kind not in _REQUIRED:
        raise LedgerError(f"unknown event kind {kind!r} (expected one of {', '.join(_REQUIRED)})")
    missing = [key for key in _REQUIRED[kind] if key not in event]
    if missing:
        raise LedgerError(f"{kind} event lacks {', '.join(map(repr, missing))}")
    for key, (ok, expected) in (_REQUIRED[kind] | _OPTIONAL.get(kind, {})).items():
        if key in event and not ok(event[key]):
            raise LedgerError(f"{kind} event: {key!r} is {event[key]!r:.80}, expected {expected}")
    for keys, lengths in _PARALLEL.get(kind, ()):
        if lengths in event and len(event[lengths]) != len(event[keys]):
            raise LedgerError(
                f"{kind} event: {len(event[lengths])} {lengths} for {len(event[keys])} {keys}"
            )


def _load(workdir_or_path: str) -> tuple[str, bytes]:
    path = workdir_or_path
    if os.path.isdir(path):
        path = os.path.join(path, LEDGER_FILE)
    elif not os.path.exists(path):
        raise LedgerError(f"{path}: no such workdir or ledger file")
    try:
        with open(path, "rb") as f:
            return path, f.read()
    except FileNotFoundError:
        raise LedgerError(f"{path}: no ledger in this workdir (did a run write to it?)") from None
    except OSError as e:
        raise LedgerError(f"{path}: cannot read the ledger ({e.strerror})") from None


def read(workdir_or_path: str) -> list[dict[str, Any]]:
    """The events of `workdir/ledger.jsonl` (or of the ledger file named), checked.

    Raises `LedgerError`, naming the file and the 1-based line, for a missing or empty file, a
    line that is not JSON or an event that lacks a key (see `check_event`). Blank lines are
    skipped.
    """
    path, data = _load(workdir_or_path)
    # `Ledger` ends every line with a newline, so the piece after the last one is empty
    # unless a write was cut off: such a line is reported as what a crash leaves, not as a
    # JSON syntax error. (Cut exactly before its newline, the object is whole and accepted.)
    lines = data.split(b"\n")
    events = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path}, line {number}"
        try:
            event = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise LedgerError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            if number == len(lines):
                raise LedgerError(
                    f"{where}: the last line is cut off (no newline, not valid JSON): the "
                    "run stopped in the middle of writing it"
                ) from None
            # Column within the line: the decoder's own "line 1" would count from this line.
            raise LedgerError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        try:
            check_event(event)
        except LedgerError as e:
            raise LedgerError(f"{where}: {e}") from None
        events.append(event)
    if not events:  # a run that stopped before its start event, or not a run's ledger
        raise LedgerError(f"{path} holds no events")
    return events
