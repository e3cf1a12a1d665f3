"""Giving the training mesh CPU cores of its own, as a pod gives it chips of its own.

Virtual CPU devices (`cpu_flags_lib`) make the training mesh and the generation meshes disjoint
meshes, but every one of them still runs on every core of the host. That is unlike the hardware
DESIGN.md targets, where the trainer's chips are not the generation instances' chips: on a
shared-core host `sync` rollout borrows the trainer's idle cores and every asynchronous mode
pays for training in contention with decoding, so a CPU benchmark measures the host more than
the paradigm. `runtime.train_cpu_cores` closes that gap for `dora-jax bench`: the trainer runs
in a process of its own (`trainer_process_lib`) pinned to that many cores, and the controller
with the engines keeps the others. Linux only (CPU affinity); the error says so elsewhere.

This module does not import JAX: a child process pins itself with it before JAX starts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dora_jax.config_fields_lib import is_count


def split(
    train_cores: int, field: str = "runtime.train_cpu_cores"
) -> tuple[frozenset[int], frozenset[int]]:
    """(the trainer's cores, the rest) out of the cores this process may run on.

    The trainer takes the highest-numbered ones. Errors name `field`, the config entry to change.
    """
    if not is_count(train_cores, 1):
        raise ValueError(f"{field} must be a positive integer, got {train_cores!r}")
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"{field}: pinning processes to cores needs Linux (set it to 0)")
    allowed = sorted(os.sched_getaffinity(0))
    if train_cores >= len(allowed):
        raise ValueError(
            f"{field}={train_cores} leaves no core for rollout: this process may run on "
            f"{len(allowed)} core(s) {allowed}"
        )
    return frozenset(allowed[-train_cores:]), frozenset(allowed[:-train_cores])


def pin_process(cores: frozenset[int]) -> None:
    """Pins every thread of this process to `cores`; threads started later inherit it.

    Affinity is per thread on Linux, and JAX's runtime threads already exist when the bench
    starts, so each one is set (a thread that ends meanwhile is skipped).
    """
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def pinned(cores: frozenset[int]) -> Iterator[None]:
    """This process on `cores` for the block, back on the cores it had after."""
    before = frozenset(os.sched_getaffinity(0))
    pin_process(cores)
    try:
        yield
    finally:
        pin_process(before)
