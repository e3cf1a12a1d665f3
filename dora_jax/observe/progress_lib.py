"""Live progress display: one line per run that updates in place (rich), or plain log lines
when the output is not a terminal (CI logs, notebooks without widgets)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

_FIELDS = (
    ("loss", "train/loss", "{:.3f}"),
    ("reward", "train/reward_mean", "{:.3f}"),
    ("stale", "train/staleness_max", "{:.0f}"),
    ("tok/s", "trained_tokens_per_s", "{:.0f}"),
    ("versions", "versions_live", "{:.0f}"),
    ("held-out pass@1", "eval/pass@1", "{:.3f}"),  # the iterations after an `eval.every` score
)


def describe(metrics: Mapping[str, Any]) -> str:
    parts = []
    for label, key, fmt in _FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(float(metrics[key]))}")
    return "  ".join(parts)


class ProgressDisplay:
    """Shows iteration i/N with reward, staleness and tokens/s as the run goes."""

    def __init__(self, total: int, title: str = "train", live: bool | None = None):
        self._live = sys.stdout.isatty() if live is None else live
        self._total = total
        self._title = title
        self._start = time.perf_counter()
        if self._live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(),
            )
            self._task = self._progress.add_task(title, total=total, info="")
            self._progress.start()

    def update(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        info = describe(metrics)
        if self._live:
            self._progress.update(self._task, completed=iteration, info=info)
        else:
            elapsed = time.perf_counter() - self._start
            print(
                f"[{self._title}] iter {iteration}/{self._total} {elapsed:6.1f}s  {info}",
                flush=True,
            )

    def close(self) -> None:
        if self._live:
            self._progress.stop()
