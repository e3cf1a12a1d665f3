"""`app_lib.load_policy` hands the run its starting policy already on the training mesh, laid
out as the trainer lays it out, from a checkpoint or from a random init, with the same values
as the checkpoint's / as `models.create`'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from dora_jax import app_lib, models, settings_lib
from dora_jax.models import sharding_lib
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.train import TrainConfig, Trainer

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
    shape = settings_lib.model_shape(config)
    reference = models.create(models.ModelConfig(vocab_size=VOCAB, **shape), seed=config.seed)
    if from_checkpoint:
        models.save_pretrained(reference, str(tmp_path))
        config.model.checkpoint = str(tmp_path)
    mesh = sharding_lib.make_mesh(jax.devices()[:4], fsdp=2, tp=2)
    _check_on_mesh(app_lib.load_policy(config, VOCAB, mesh), reference, mesh)


@pytest.mark.parametrize("from_checkpoint", [True, False], ids=["checkpoint", "random"])
def test_bfloat16_computes_in_bfloat16_and_trains_float32_master_weights(tmp_path, from_checkpoint):
    """`model.dtype="bfloat16"` held the params themselves in bfloat16, where an update of
    ~lr = 1e-6 rounds away (a weight of 0.02 has a spacing of ~1e-4): one AdamW step moved
    almost no parameter, so RL at the recipe's learning rate did nothing. The master weights
    are float32 now, and one step moves nearly every one of them."""
    config = default.get_config()
    config.model.dtype = "bfloat16"
    if from_checkpoint:
        shape = settings_lib.model_shape(config)
        bf16 = models.create(
            models.ModelConfig(vocab_size=VOCAB, **shape), param_dtype=jnp.bfloat16
        )
        models.save_pretrained(bf16, str(tmp_path))  # a bfloat16 checkpoint, as HF's are
        config.model.checkpoint = str(tmp_path)
    mesh = sharding_lib.make_mesh(jax.devices()[:1], fsdp=1, tp=1)
    model = app_lib.load_policy(config, VOCAB, mesh)
    assert model.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("float32")}
    trainer = Trainer(model, TrainConfig(tbs=4, group_size=4, learning_rate=1e-6), mesh)
    rng = np.random.default_rng(0)
    batch = [
        Trajectory(
            prompt_id=0,
            sample_index=i,
            prompt_tokens=rng.integers(0, VOCAB, 5).astype(np.int32),
            response_tokens=rng.integers(0, VOCAB, 9).astype(np.int32),
            behaviour_logprobs=np.full(9, -3.7, np.float32),
            version=0,
            token_versions=np.zeros(9, np.int32),
            reward=float(i % 2),
        )
        for i in range(4)
    ]
    before = jax.device_get(jax.tree.leaves(trainer.params))
    trainer.step(batch)
    after = jax.device_get(jax.tree.leaves(trainer.params))
    moved = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    assert moved > 0.9 * sum(a.size for a in after)
