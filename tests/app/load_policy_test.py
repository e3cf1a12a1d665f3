"""`app_lib.load_policy` hands the run its starting policy already on the training mesh, laid
out as the trainer lays it out, from a checkpoint or from a random init, with the same values
as the checkpoint's / as `models.create`'s."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from dora_jax import app_lib, models
from dora_jax.models import sharding_lib

VOCAB = 40


def _check_on_mesh(model: models.Transformer, reference: models.Transformer, mesh) -> None:
    state = nnx.state(model, nnx.Param)
    expected = dict(nnx.to_flat_state(sharding_lib.param_shardings(state, mesh)))
    values = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
    sharded = 0
    for path, variable in nnx.to_flat_state(state):
        array = variable.get_value()
        assert array.sharding == expected[path].get_value(), path
        np.testing.assert_array_equal(array, values[path].get_value(), err_msg=str(path))
        sharded += array.sharding.shard_shape(array.shape) != array.shape
    assert sharded, "nothing was sharded"


@pytest.mark.parametrize("from_checkpoint", [True, False], ids=["checkpoint", "random"])
def test_policy_lands_on_the_training_mesh(tmp_path, from_checkpoint):
    config = default.get_config()
    shape = {k: v for k, v in config.model.items() if k not in ("checkpoint", "dtype")}
    reference = models.create(models.ModelConfig(vocab_size=VOCAB, **shape), seed=config.seed)
    if from_checkpoint:
        models.save_pretrained(reference, str(tmp_path))
        config.model.checkpoint = str(tmp_path)
    mesh = sharding_lib.make_mesh(jax.devices()[:4], fsdp=2, tp=2)
    _check_on_mesh(app_lib.load_policy(config, VOCAB, mesh), reference, mesh)
