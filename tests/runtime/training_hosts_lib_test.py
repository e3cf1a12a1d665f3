"""A trainer on a training group (two processes, `jax.distributed` over gloo) against the same
trainer on the same mesh shape in one process: the same updates, restore included."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import training_group_main as group_main
from train_fixtures import tiny_model

from dora_jax.models import sharding_lib
from dora_jax.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_group_trainer_matches_one_process_on_the_same_mesh(tmp_path):
    out = tmp_path / "group.npz"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets 2 devices
    result = subprocess.run(
        [sys.executable, str(pathlib.Path(group_main.__file__)), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
