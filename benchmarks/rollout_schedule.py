"""A bench config's rollout schedule in seconds, on the engine double instead of the model.

    .venv/bin/python benchmarks/rollout_schedule.py --config=configs/bench_longtail.py \
        [--config.modes=partial,dora] [--config.runtime.num_instances=6 --config.engine.slots=8]

With lengths forced, a run's schedule (which instance decodes which version at which step, with
how many busy slots) depends on the config and seed only, so `tests/rollout`'s engine double,
which honours the engine's contract without a model, gives exactly the real bench's decode steps,
instance steps and slot occupancy (`bench_lib_test` checks it). What it cannot give is time: the
real bench's wall clock also depends on what each step costs on the machine. Use it to see how a
layout or a rollout setting moves the schedule (the occupancy ceiling under C1, the decoding
spent on old versions' tails) before paying for the real run. Prints a markdown table.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

from absl import app, logging
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "rollout"))

from dora_jax.rollout import ledger_lib, telemetry_lib  # noqa: E402
from dora_jax.runtime import cpu_flags_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "A bench config (configs/*.py).")


def _staleness(workdir: str) -> tuple[float, int]:
    stale = [e["staleness"] for e in ledger_lib.read(workdir) if e["event"] == "train"]
    return sum(stale) / len(stale), max(stale)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend probing, at INFO
    config = _CONFIG.value
    # The doubles need a mesh each, not compute: a training device and one per instance.
    cpu_flags_lib.use_cpu_devices(config.runtime.num_instances + 1)
    from rollout_harness import bench_schedule

    r, w = config.rollout, config.workload
    print(
        f"{config.runtime.num_instances} instances x {config.engine.slots} slots, "
        f"TBS {r.train_batch_size}, {r.num_iterations} iterations, lengths: median "
        f"{w.median_length}, max {w.max_length}, sigma {w.sigma}\n"
    )
    lags = " | ".join(f"{lag}: steps (occupancy)" for lag in telemetry_lib.LAG_LABELS)
    columns = "entry | decode steps | instance steps | slot occupancy"
    print(f"| {columns} | {lags} | staleness mean / max |")
    print("|---" * (5 + len(telemetry_lib.LAG_LABELS)) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for entry in config.modes.split(","):
            workdir = os.path.join(tmp, entry)
            f = bench_schedule(config, entry, workdir)
            by_lag = " | ".join(
                f"{f[f'instance_steps/{lag}']:.0f} ({f[f'step_occupancy/{lag}']:.2f})"
                for lag in telemetry_lib.LAG_LABELS
            )
            mean, worst = _staleness(workdir)
            print(
                f"| {entry} | {f['decode_steps']:.0f} | {f['instance_steps']:.0f} | "
                f"{f['step_occupancy']:.3f} | {by_lag} | {mean:.2f} / {worst} |",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
