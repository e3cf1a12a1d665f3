"""XLA flags for running dora_jax on a CPU host; they must be set before JAX initialises.

This module does not import JAX, so the CLI, the test suite's conftest and the notebook can call
it first. Two flags:

- `--xla_force_host_platform_device_count=N` splits the host into N virtual devices, so the
  training mesh and the generation meshes are real, disjoint meshes on a laptop or CI box.
- `--xla_cpu_multi_thread_eigen=false` runs each device's ops on one thread. XLA's multi-threaded
  Eigen pool is known to wedge for good on small CI machines (PyAutoLabs/PyAutoFit#1528 pins such a
  hang to this flag), and this project's 2-core CI once hung until its time limit. It also fits
  the design: on a CPU host, parallelism comes from the virtual devices running side by side;
  per-op threads only make the meshes fight over the same cores.

A flag the user already set in `XLA_FLAGS` is left as it is.
"""

from __future__ import annotations

import os

from dora_jax.config_fields_lib import is_count


def use_cpu_devices(count: int) -> None:
    """Adds the CPU-host flags to `XLA_FLAGS` (each unless already present)."""
    if not is_count(count, 1):
        raise ValueError(f"num_cpu_devices must be a positive integer, got {count!r}")
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = {
        "xla_force_host_platform_device_count": str(count),
        "xla_cpu_multi_thread_eigen": "false",
    }
    for name, value in wanted.items():
        if name not in flags:
            flags = f"{flags} --{name}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()
