"""cpu_flags_lib: the CPU-host XLA flags reach a fresh JAX process; the user's own flags win."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dora_jax.runtime import cpu_flags_lib

PROBE = """
import json, os
from dora_jax.runtime import cpu_flags_lib
cpu_flags_lib.use_cpu_devices(3)
import jax
print(json.dumps({"devices": jax.device_count(), "flags": os.environ["XLA_FLAGS"]}))
"""


def _probe(xla_flags: str | None) -> dict:
    env = {"JAX_PLATFORMS": "cpu", "PATH": ""}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_fresh_process_gets_the_devices_and_single_threaded_eigen():
    got = _probe(None)
    assert got["devices"] == 3
    assert got["flags"].split() == [
        "--xla_force_host_platform_device_count=3",
        "--xla_cpu_multi_thread_eigen=false",
    ]


def test_flags_the_user_set_are_kept():
    got = _probe("--xla_force_host_platform_device_count=5 --xla_cpu_multi_thread_eigen=true")
    assert got["devices"] == 5
    assert "--xla_cpu_multi_thread_eigen=true" in got["flags"]
    assert "false" not in got["flags"]


@pytest.mark.parametrize("count", [0, -2, 2.5, "8"])
def test_a_bad_device_count_names_the_field(count, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(ValueError, match="num_cpu_devices"):
        cpu_flags_lib.use_cpu_devices(count)
