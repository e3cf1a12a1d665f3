"""Test-wide set-up: 8 virtual CPU devices, so multi-device meshes are real in every test.

XLA reads the flag when JAX initialises its backend, so it is set here, before any test module
imports JAX.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
