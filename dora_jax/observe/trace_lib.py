"""Timeline traces in Chrome trace-event format (open `trace.json` in Perfetto or chrome://tracing).

One track (thread) per rollout instance and one for the trainer, so a reader sees at a glance
which policy version each instance hosted, when it decoded, prefilled, migrated or sat idle,
and when the trainer waited. Times are microseconds since the Unix epoch, so that a run resumed
from a checkpoint continues the trace of the run before it on one timeline: the earlier run's
events stay, as a process of their own, and the gap between them is the restart.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

TRACE_FILE = "trace.json"  # in the workdir


class TraceWriter:
    """Collects complete ("X") events on named tracks and writes them as one JSON file."""

    def __init__(self, process_name: str = "dora_jax", previous: str | None = None):
        """`previous`: a trace file whose events this one keeps (the run it resumes)."""
        self._origin = time.perf_counter()
        self._epoch_us = time.time() * 1e6
        self._tracks: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []
        self._process_name = process_name
        self._earlier: list[dict[str, Any]] = []
        if previous is not None and os.path.exists(previous):
            with open(previous) as f:
                self._earlier = json.load(f)["traceEvents"]
        self._pid = max((e.get("pid", 0) for e in self._earlier), default=0) + 1

    def now_us(self) -> float:
        return self._epoch_us + (time.perf_counter() - self._origin) * 1e6

    def _tid(self, track: str) -> int:
        if track not in self._tracks:
            self._tracks[track] = len(self._tracks) + 1
        return self._tracks[track]

    def span(self, track: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
        """Records `name` on `track` from `start_us` to `end_us` with optional arguments."""
        self._events.append(
            {
                "ph": "X",
                "pid": self._pid,
                "tid": self._tid(track),
                "name": name,
                "ts": start_us,
                "dur": max(end_us - start_us, 0.0),
                "args": args,
            }
        )

    def to_json(self) -> dict[str, Any]:
        pid = self._pid
        meta = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": self._process_name}}
        ]
        meta += [
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}}
            for track, tid in self._tracks.items()
        ]
        return {"traceEvents": self._earlier + meta + self._events, "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)
