"""`dora-jax COMMAND --config=configs/x.py [--config.a.b=v ...]`: the command-line entry point.

Commands are absl apps sharing the flax-examples convention: an ml_collections config file
with `get_config()` and `--config.field=value` overrides.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for run outputs.")

COMMANDS = ("train",)


def _use_cpu_devices(count: int) -> None:
    """Splits the host CPU into `count` XLA devices; must run before JAX initialises."""
    flag = f"--xla_force_host_platform_device_count={count}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _train(argv: list[str]) -> None:
    del argv
    config = _CONFIG.value
    _use_cpu_devices(config.num_cpu_devices)
    from dora_jax import demo

    demo.model_round_trip(config, _WORKDIR.value)


def run() -> None:
    """Console-script entry point: the first argument names the command."""
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: dora-jax {{{'|'.join(COMMANDS)}}} --config=configs/default.py [flags]")
    command = sys.argv.pop(1)
    app.run({"train": _train}[command])


if __name__ == "__main__":
    run()
