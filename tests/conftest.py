"""Test-wide set-up: 8 virtual CPU devices, so multi-device meshes are real in every test, and
the persistent compilation cache the CLI uses by default.

XLA reads its flags when JAX initialises its backend, so they are set here, before any test module
imports JAX, by the same functions the CLI uses (they import no JAX themselves). Subprocesses the
tests start (the CLI, generation and training hosts, the notebook's kernel) inherit them. The
cache lets both pytest workers and every process they start load a program the suite compiled
once; it cannot change a result (`tests/runtime/compile_cache_lib_test.py`,
`tests/app/resume_kill_test.py`).
"""

import os

from dora_jax.runtime import compile_cache_lib, cpu_flags_lib

cpu_flags_lib.use_cpu_devices(8)
compile_cache_lib.use_compilation_cache(compile_cache_lib.DEFAULT_DIRECTORY)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
