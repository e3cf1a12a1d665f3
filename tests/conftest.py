"""Test-wide set-up: 8 virtual CPU devices, so multi-device meshes are real in every test.

XLA reads its flags when JAX initialises its backend, so they are set here, before any test module
imports JAX, by the same function the CLI uses (it imports no JAX itself). Subprocesses the tests
start (the CLI, the notebook's kernel) inherit them.
"""

import os

from dora_jax.runtime import cpu_flags_lib

cpu_flags_lib.use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
