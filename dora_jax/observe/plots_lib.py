"""The run's summary figure (`summary.png`): reward and response length against iteration and
against wall-clock, versions live and decode-slot occupancy.

Plotting against wall-clock as well as iteration is the point: async modes win by doing the
same iterations in less time, which an iteration axis alone hides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (
    ("train/reward_mean", "step", "reward vs iteration", "iteration"),
    ("train/reward_mean", "wall_time_s", "reward vs wall-clock", "seconds"),
    ("train/response_length_mean", "step", "response length vs iteration", "iteration"),
    ("train/response_length_mean", "wall_time_s", "response length vs wall-clock", "seconds"),
    ("versions_live", "step", "policy versions live", "iteration"),
    ("slot_occupancy", "step", "decode-slot occupancy", "iteration"),
)


def plot_summary(records: Sequence[dict[str, Any]], path: str, title: str = "dora_jax") -> None:
    """Draws the six panels from metrics records (as `metrics_lib.read_metrics` returns)."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (y_key, x_key, label, x_label) in zip(axes.T.flat, PANELS, strict=True):
        # `MetricsWriter` stores non-finite values as the strings "nan"/"inf"; handed to
        # matplotlib as-is they turn the axis categorical, so they are dropped here.
        pairs = ((float(r[x_key]), float(r[y_key])) for r in records if x_key in r and y_key in r)
        points = [(x, y) for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=".", linewidth=1)
        else:
            ax.text(0.5, 0.5, f"no {y_key}", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
