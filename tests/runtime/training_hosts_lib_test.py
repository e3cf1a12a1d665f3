"""A trainer on a training group (two processes, `jax.distributed` over gloo) against the same
trainer on the same mesh shape in one process: the same updates, restore included; with the
training host a child process and a `dora-jax host` reached over TCP."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import training_group_main as group_main
from flax import nnx
from train_fixtures import tiny_model

from dora_jax.models import sharding_lib
from dora_jax.runtime import hosts_lib, training_hosts_lib
from dora_jax.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("host", ["child", "network"])
def test_group_trainer_matches_one_process_on_the_same_mesh(tmp_path, host):
    out = tmp_path / "group.npz"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env[hosts_lib.KEY_VARIABLE] = "a test secret"
    env["PYTHONPATH"] = str(ROOT / "tests" / "runtime")  # the trainer's factory, for the host
    command = [sys.executable, str(pathlib.Path(group_main.__file__)), str(out)]
    server = None
    if host == "network":
        address = f"127.0.0.1:{training_hosts_lib.free_port()}"
        server = subprocess.Popen(
            [sys.executable, "-m", "dora_jax.cli", "host", f"--address={address}",
             "--num_cpu_devices=2"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert "listening" in server.stdout.readline()
        command.append(address)
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        if server is not None:  # a training host serves one group, then returns
            assert server.wait(timeout=120) == 0
    finally:
        if server is not None and server.poll() is None:
            server.kill()
    group = np.load(out)

    mesh = sharding_lib.make_mesh(jax.devices()[:4], *group_main.MESH_SHAPE)
    one = group_main.train(Trainer(tiny_model(), group_main.CONFIG, mesh), group_main.batches())

    assert group["host_arrays"], "published params must come back as host arrays"
    assert int(group["version"]) == int(one["version"]) == 2
    for key in ("loss1", "loss2", "loss2_again"):
        np.testing.assert_allclose(group[key], one[key], rtol=1e-5, err_msg=key)
    for key in ("v1", "v2", "v2_again"):
        np.testing.assert_allclose(group[key], one[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # The updates are real (the params moved) and restore is exact on the group.
    assert np.abs(group["v2"] - group["v1"]).max() > 1e-4
    np.testing.assert_array_equal(group["v2_again"], group["v2"])
    if host == "child":  # LoRA: the second version gathered as adapters, merged onto the base
        lora = group_main.train_lora(Trainer(group_main.lora_model(), group_main.CONFIG, mesh))
        for key in ("lora_v1", "lora_v2"):
            np.testing.assert_allclose(group[key], lora[key], rtol=1e-5, atol=1e-7, err_msg=key)
        assert np.abs(group["lora_v2"] - group["lora_v1"]).max() > 1e-4
        assert group["lora_base_shared"]  # gathered once, then each version's adapters
        adapters = nnx.filter_state(nnx.state(group_main.lora_model()), nnx.LoRAParam)
        assert group["lora_publish_bytes"] == sum(x.nbytes for x in jax.tree.leaves(adapters))
        whole = nnx.state(group_main.lora_model())
        assert group["lora_first_publish_bytes"] == sum(x.nbytes for x in jax.tree.leaves(whole))
