"""JAX's persistent compilation cache, shared by every process of a run and by later runs.

A run compiles the engine's prefill buckets and decode step for every generation mesh, a
training step per length bucket, and the small programs around them; a restart after a
preemption or a crash, a generation or training host, and the next experiment compile the same
programs again. With the cache they load them instead: the tests' tiny `dora-jax train` starts
and finishes in 23-25 s instead of 67-70 s on the 2-core CI machine (BENCHMARKS.md), and on
TPU/GPU it saves the minutes each restart spends compiling. JAX keys an entry by the program,
the devices, the compile options and the jax/XLA versions, so a hit is the executable a fresh
compile would build: a run writes the same ledger with a cold cache, a warm one or none
(tests/app/resume_kill_test.py).

Like `cpu_flags_lib`, this module does not import JAX: the settings go into the environment,
where JAX reads them when it is imported, here and in every child process (generation and
training hosts started with `local`); a JAX already imported is updated as well. Either way it
must come before JAX compiles anything: JAX decides once, at its first compilation, whether
the cache is on.
"""

from __future__ import annotations

import os
import sys

# Unbounded (the whole test suite writes ~40 MB; delete the directory to clear it). JAX's size
# bound is not used: with one, every write re-reads the size and access time of every entry
# under a lock, which made the test suite's cold run 5 minutes slower. Without the lock a reader
# may meet an entry another process is still writing; JAX then warns and compiles instead.
DEFAULT_DIRECTORY = "~/.cache/dora_jax/jax_compilation"


def use_compilation_cache(directory: str) -> None:
    """Caches every compiled program under `directory`; "" turns the cache off, also where an
    inherited environment had turned it on."""
    if not isinstance(directory, str):
        raise ValueError(
            f"compilation_cache_dir must be a directory path or '' (off), got {directory!r}"
        )
    settings = {
        "jax_compilation_cache_dir": os.path.expanduser(directory) if directory else None,
        # Every program, however quick to compile: a run has hundreds of small ones.
        "jax_persistent_cache_min_compile_time_secs": 0.0,
    }
    for name, value in settings.items():
        if value is None:
            os.environ.pop(name.upper(), None)
        else:
            os.environ[name.upper()] = str(value)
    if "jax" in sys.modules:
        for name, value in settings.items():
            sys.modules["jax"].config.update(name, value)
