"""The run ledger, `WORKDIR/ledger.jsonl`: one JSON object per line, the audit's only input.

Events (issue 5): `start` (the bounds the audit checks against, so it needs nothing but the
file), `dispatch` when a sample starts decoding (again, with the same key, when a failed
instance's sample is regenerated), `train` when a sample is trained (its step done, the new
version taken up), `end` when the run stops with what was still in flight and what sat
finished, untrained (in the trajectory queue, or handed to a trainer that did not finish its
step). Lines are written
in the orchestrator's logical order, so the same config and seed give a byte-identical file.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dora_jax.rollout.trajectory_lib import Trajectory

LEDGER_FILE = "ledger.jsonl"


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

    def start(self, *, mode: str, staleness_bound: int, train_batch_size: int, group_size: int):
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
        in_flight: list[tuple[int, int]],
        queued: list[Trajectory],
    ) -> None:
        self._write(
            {
                "event": "end",
                "in_flight": [list(k) for k in in_flight],
                "queued": [list(t.key) for t in queued],
                # Lengths of the finished-but-untrained samples, for the audit's length bias.
                "queued_response_lengths": [len(t.response_tokens) for t in queued],
            }
        )

    def close(self) -> None:
        self._file.close()


def read(workdir_or_path: str) -> list[dict[str, Any]]:
    path = workdir_or_path
    if os.path.isdir(path):
        path = os.path.join(path, LEDGER_FILE)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
