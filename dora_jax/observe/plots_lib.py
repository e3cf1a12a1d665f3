"""The run's summary figure (`summary.png`): reward and response length against iteration and
against wall-clock (with held-out pass@1 where `eval.every` measured it), versions live and
decode-slot occupancy.

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


def plot_summary(
    records: Sequence[dict[str, Any]],
    path: str,
    title: str = "dora_jax",
    held_out: Sequence[tuple[float, float]] = (),
) -> None:
    """Draws the six panels from metrics records (as `metrics_lib.read_metrics` returns);
    `held_out` adds (version, pass@1) points to those the records hold (the scores before and
    after RL, which no iteration's record carries)."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (y_key, x_key, label, x_label) in zip(axes.T.flat, PANELS, strict=True):
        points = _points(records, x_key, y_key)
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", linewidth=1, label=y_key)
        else:
            ax.text(0.5, 0.5, f"no {y_key}", ha="center", va="center", transform=ax.transAxes)
        # Held-out pass@1 on the same 0-1 scale as a verifiable reward, at the version scored.
        if y_key == "train/reward_mean" and x_key == "step":
            scored = sorted([*_points(records, "eval/version", "eval/pass@1"), *held_out])
            if scored:
                ax.plot(*zip(*scored, strict=True), marker="o", label="held-out pass@1")
                ax.legend(loc="lower right")
        ax.set_title(label)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _points(records: Sequence[dict[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    """(x, y) of the records holding both, finite ones only: `MetricsWriter` stores non-finite
    values as the strings "nan"/"inf", which handed to matplotlib turn the axis categorical."""
    pairs = ((float(r[x_key]), float(r[y_key])) for r in records if x_key in r and y_key in r)
    return [(x, y) for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
