"""The persistent compilation cache: reused across processes and by their children, the same
results as a fresh compile, off when asked."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from dora_jax.runtime import compile_cache_lib

SCRIPT = pathlib.Path(__file__).with_name("compile_cache_main.py")


def _run(directory: str, inherited: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    if inherited is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = inherited
    done = subprocess.run(
        [sys.executable, str(SCRIPT), directory],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_and_its_children_load_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run(str(cache))
    assert first["parent"]["directory"] == str(cache) and first["parent"]["hits"] == 0
    assert any(cache.iterdir()), "nothing was written to the cache"
    # The spawned child inherits the setting and loads the parent's program.
    assert first["child"]["directory"] == str(cache) and first["child"]["hits"] > 0
    second = _run(str(cache))
    assert second["parent"]["hits"] > 0 and second["child"]["hits"] > 0
    # "" is off, also when the environment this process inherited had it on.
    off = _run("", inherited=str(cache))
    assert off["parent"]["directory"] is None and off["child"]["directory"] is None
    assert off["parent"]["hits"] == 0 and off["child"]["hits"] == 0
    # A loaded executable computes what a fresh compile (the cache off) computes, bit for bit.
    results = {r[who]["result"] for r in (first, second, off) for who in ("parent", "child")}
    assert len(results) == 1


@pytest.mark.parametrize("value", [None, 3, b"dir"])
def test_a_bad_value_names_the_field(value):
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        compile_cache_lib.use_compilation_cache(value)
