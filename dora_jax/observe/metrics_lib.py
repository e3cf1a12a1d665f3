"""Per-iteration metrics: TensorBoard event files plus a `metrics.jsonl` mirror.

TensorBoard is what users open; the JSON-lines mirror is what the summary plot, the notebook and
tests read back without a TensorBoard dependency. Non-finite and non-numeric values are
skipped for TensorBoard (it cannot plot them) but kept in the JSON mirror as strings, so
nothing measured is lost.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"  # in the workdir, beside TensorBoard's event files


class MetricsWriter:
    """Writes one scalar per metric per step under `workdir` (`events.*` and `metrics.jsonl`).

    `resume_offset` is the `offset()` a checkpoint recorded (None starts a new run) and
    `first_step` the first step this writer writes: TensorBoard drops the steps from it on that
    earlier writers left in the workdir (a resumed run redoes them), as `metrics.jsonl` does.
    """

    def __init__(self, workdir: str, resume_offset: int | None = None, first_step: int = 1):
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, METRICS_FILE)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if (resume_offset or 0) > size:  # truncate() would pad the file with NUL bytes
            raise ValueError(
                f"{path} has {size} bytes, fewer than the {resume_offset} its checkpoint "
                "recorded: this workdir's metrics are not the checkpointed run's"
            )
        self._tb = SummaryWriter(logdir=workdir, flush_secs=5, purge_step=first_step)
        self._jsonl = open(path, "a")  # noqa: SIM115 - held for the run's lifetime
        # A new run starts the file afresh; a resumed one drops the records written after its
        # checkpoint, since it redoes those iterations.
        self._jsonl.truncate(resume_offset or 0)

    def offset(self) -> int:
        """Bytes of `metrics.jsonl` written so far: where a resumed run continues."""
        self._jsonl.flush()
        return self._jsonl.tell()

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record: dict[str, Any] = {"step": step}
        for name, value in metrics.items():
            if isinstance(value, bool | int | float) and math.isfinite(float(value)):
                self._tb.add_scalar(name, float(value), global_step=step)
                record[name] = value
            else:
                record[name] = value if isinstance(value, list | dict | str) else str(value)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        self._tb.close()
        self._jsonl.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The records `MetricsWriter` wrote to `workdir/metrics.jsonl`, in order."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
