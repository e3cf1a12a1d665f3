"""Where the time goes in a rollout run, from its `trace.json` alone.

    python benchmarks/trace_breakdown.py runs/bench          # every mode under the bench dir
    python benchmarks/trace_breakdown.py runs/bench/dora     # one run

For each track (instances, trainer) it sums the span time per kind (the span name's first
word: decode, prefill+decode, idle, load, migrate, train) and prints it as a fraction of the
run's wall time (first to last trace event). Time on an instance track not covered by any span
is time the controller spent elsewhere (waiting for the trainer, orchestrating).
"""

from __future__ import annotations

import collections
import json
import os
import sys


def breakdown(trace_path: str) -> tuple[float, dict[str, dict[str, float]]]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    tracks: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
    for e in spans:
        tracks[names.get(e["tid"], str(e["tid"]))][e["name"].split()[0]] += e["dur"] / 1e6
    return (end - start) / 1e6, tracks


def main(path: str) -> None:
    runs = (
        [path]
        if os.path.exists(os.path.join(path, "trace.json"))
        else sorted(
            os.path.join(path, d)
            for d in os.listdir(path)
            if os.path.exists(os.path.join(path, d, "trace.json"))
        )
    )
    for run in runs:
        wall, tracks = breakdown(os.path.join(run, "trace.json"))
        print(f"{os.path.basename(run)}: {wall:.2f} s traced")
        for track in sorted(tracks):
            parts = sorted(tracks[track].items(), key=lambda kv: -kv[1])
            gap = wall - sum(tracks[track].values())
            cells = [f"{k} {v / wall:5.1%}" for k, v in parts] + [f"uncovered {gap / wall:5.1%}"]
            print(f"  {track:<11} " + "  ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/bench")
