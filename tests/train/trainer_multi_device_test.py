"""One update on an 8-device (fsdp=4, tp=2) mesh equals the same update on one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from train_fixtures import TINY, random_batch, tiny_model

from dora_jax.models import LoRAConfig, create, sharding_lib
from dora_jax.train import TrainConfig, Trainer, batch_lib, trainer_lib

# Linear first AdamW step (eps >> |g|): parameter changes are proportional to the gradient, so
# the comparison checks the sharded gradient itself, not just its sign.
CONFIG = TrainConfig(
    tbs=8,
    group_size=4,
    mini_batches=2,
    micro_batch_size=4,
    learning_rate=1e3,
    adam_eps=1e3,
    max_grad_norm=None,
    length_buckets=(8, 16),
)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize(
    "micro,lora",
    [({}, None), ({"micro_batch_size": None, "micro_batch_tokens": 32}, None),
     ({}, LoRAConfig(rank=2))],
    ids=["rows", "tokens", "lora"],
)  # fmt: skip
def test_sharded_update_equals_single_device_update(micro, lora):
    """Also under a token budget: its micro-batches here hold 3, 1, 2 and 2 samples, each padded
    with empty rows to 4, one row per fsdp device. And for LoRA adapters, whose A shards as its
    kernel's input axis and B as its output axis."""
    config = dataclasses.replace(CONFIG, **micro)
    model = lambda: create(TINY, 0, lora=lora)
    batch = random_batch(np.random.RandomState(0), 2, 4, max_response=12)
    if config.micro_batch_tokens:
        cut = [
            mb
            for m in range(2)
            for mb in batch_lib.micro_batches(
                batch, np.arange(4 * m, 4 * m + 4), config.length_buckets, False,
                tokens=config.micro_batch_tokens, min_rows=4,
            )
        ]  # fmt: skip
        assert [(int((mb.rows >= 0).sum()), mb.tokens.shape) for mb in cut] == [
            (3, (4, 8)), (1, (4, 16)), (2, (4, 16)), (2, (4, 16))
        ]  # fmt: skip
    single = Trainer(model(), config, sharding_lib.make_mesh(jax.devices()[:1], 1, 1))
    for t, lp in zip(batch, single.logprobs(batch), strict=True):
        t.behaviour_logprobs = lp - 0.05
    mesh = sharding_lib.make_mesh(jax.devices(), 4, 2)
    sharded = Trainer(model(), config, mesh)
    before = _host(single.params)
    m1, m8 = single.step(batch), sharded.step(batch)
    for key in ("loss", "ratio_mean", "entropy", "grad_norm"):
        np.testing.assert_allclose(m8[key], m1[key], rtol=1e-4, err_msg=key)
    for b, a1, a8 in zip(before, _host(single.params), _host(sharded.params), strict=True):
        np.testing.assert_allclose(a8 - b, a1 - b, rtol=1e-3, atol=1e-6)

    # Params and the optimizer's moments stay sharded by the model's rules after the update.
    shardings = sharding_lib.param_shardings(sharded.params, mesh)
    want = jax.tree.leaves(shardings)
    assert any(any(axis is not None for axis in w.spec) for w in want), "nothing was sharded"
    for x, w in zip(jax.tree.leaves(sharded.params), want, strict=True):
        assert x.sharding.is_equivalent_to(w, x.ndim), (x.sharding, w)
    mu = optax.tree_utils.tree_get(sharded.state["opt_state"], "mu")
    trained = nnx.filter_state(shardings, nnx.LoRAParam if lora else nnx.Param)
    for x, w in zip(jax.tree.leaves(mu), jax.tree.leaves(trained), strict=True):
        assert x.sharding.is_equivalent_to(w, x.ndim), (x.sharding, w)


def test_publish_moves_params_to_a_generation_mesh():
    trainer = Trainer(tiny_model(), CONFIG, sharding_lib.make_mesh(jax.devices()[:4], 2, 2))
    gen_mesh = sharding_lib.make_mesh(jax.devices()[4:], 1, 4)
    pub = trainer.publish(sharding_lib.param_shardings(trainer.params, gen_mesh))
    expect = nnx.state(tiny_model(), nnx.Param)
    for got, want in zip(jax.tree.leaves(pub.params), jax.tree.leaves(expect), strict=True):
        assert got.sharding.device_set == set(jax.devices()[4:])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert pub.version == 1 and pub.metrics["publish_seconds"] > 0


def test_max_grad_norm_clips_identically_on_both_meshes():
    config = dataclasses.replace(CONFIG, max_grad_norm=1e-3, learning_rate=1e-3, adam_eps=1e-8)
    batch = random_batch(np.random.RandomState(1), 2, 4)
    trainers = [
        Trainer(tiny_model(), config, sharding_lib.make_mesh(jax.devices()[:1], 1, 1)),
        Trainer(tiny_model(), config, sharding_lib.make_mesh(jax.devices(), 2, 4)),
    ]
    norms = [t.step(batch)["grad_norm"] for t in trainers]
    np.testing.assert_allclose(norms[0], norms[1], rtol=1e-4)
    assert norms[0] > 1e-3  # the clip was active


@pytest.mark.parametrize("fsdp,tp", [(1, 1), (2, 1), (4, 2)])
def test_the_update_compiles_once_on_every_mesh_shape(fsdp, tp):
    """The params and optimizer state the first update returns must carry the shardings they
    went in with, spelled the same: jit hands back `P('fsdp')` for `P('fsdp', 'tp')` on a
    1-wide tp axis and `P()` for `P(None,)`, and each spelling compiled the whole update anew."""
    mesh = sharding_lib.make_mesh(jax.devices()[: fsdp * tp], fsdp, tp)
    # A learning rate of its own: no other test's compilation of this config is in the cache.
    config = dataclasses.replace(CONFIG, learning_rate=1e3 + 10 * fsdp + tp)
    trainer = Trainer(tiny_model(), config, mesh)
    before = trainer_lib._apply._cache_size()
    for seed in range(3):
        batch = random_batch(np.random.RandomState(seed), 2, 4, max_response=12)
        for t, lp in zip(batch, trainer.logprobs(batch), strict=True):
            t.behaviour_logprobs = lp
        trainer.step(batch)
    assert trainer_lib._apply._cache_size() == before + 1
