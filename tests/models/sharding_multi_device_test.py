"""The same model on one device and sharded over 8 virtual CPU devices gives the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dora_jax.models import Functional, ModelConfig, create, sharding_lib

CONFIGS = {
    "dense": ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        qk_norm=True,
    ),
    "moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        qk_norm=True,
        num_experts=4,
        moe_intermediate_size=32,
    ),
}


def test_eight_devices_available():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("fsdp,tp", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_sharded_logits_equal_single_device(name, fsdp, tp):
    config = CONFIGS[name]
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (8, 16)), jnp.int32)
    single = np.asarray(jax.jit(lambda m, x: m(x))(create(config, seed=5), ids))

    model = create(config, seed=5)
    mesh = sharding_lib.make_mesh(jax.devices(), fsdp, tp)
    sharding_lib.shard_model(model, mesh)
    specs = [v.sharding.spec for v in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert any(any(axis is not None for axis in spec) for spec in specs), "nothing was sharded"
    fn, params = Functional.of(model)
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    sharded = jax.jit(fn.logits)(params, jax.device_put(ids, data))
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(sharded), single, atol=1e-5)


def test_indivisible_dimensions_stay_replicated():
    mesh = sharding_lib.make_mesh(jax.devices(), 2, 4)
    spec = sharding_lib.partition_spec((6, 64), ("kv_heads", "embed"), mesh)
    assert spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_mesh_size_mismatch_is_explained():
    with pytest.raises(ValueError, match="needs 6 devices"):
        sharding_lib.make_mesh(jax.devices(), 3, 2)
