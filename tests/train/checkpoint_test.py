"""Round trips through real orbax checkpoints, including a grain iterator and sharded arrays."""

from __future__ import annotations

import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dora_jax.models import ModelConfig, create, sharding_lib
from dora_jax.train.checkpoint_lib import Checkpointer

CONFIG = ModelConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)


def _dataset():
    return grain.MapDataset.range(100).shuffle(seed=3).map(lambda x: x * 2).to_iter_dataset()


def test_resume_restores_params_optimizer_iterator_and_meta(tmp_path):
    mesh = sharding_lib.make_mesh(jax.devices(), 4, 2)
    model = sharding_lib.shard_model(create(CONFIG, seed=1), mesh)
    params = nnx.state(model, nnx.Param)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    iterator = iter(_dataset())
    consumed = [next(iterator) for _ in range(7)]
    ckpt = Checkpointer(str(tmp_path), keep=2)
    meta = {"version": 7, "ledger_offset": 1234, "rollout": {"queued": [[3, 1]]}}
    state = {"params": params, "opt_state": opt_state}
    ckpt.save(7, train_state=state, data_iterator=iterator, meta=meta)
    expected_next = [next(iterator) for _ in range(5)]
    ckpt.close()

    fresh = Checkpointer(str(tmp_path), keep=2)
    assert fresh.latest_step() == 7
    target = nnx.state(sharding_lib.shard_model(create(CONFIG, seed=2), mesh), nnx.Param)
    resumed_iter = iter(_dataset())
    like = {"params": target, "opt_state": tx.init(target)}
    out = fresh.restore(7, train_state_like=like, data_iterator=resumed_iter)
    assert out.meta == meta
    for a, b in zip(jax.tree.leaves(out.train_state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    assert [next(resumed_iter) for _ in range(5)] == expected_next
    assert consumed != expected_next


def test_restore_params_reads_the_params_alone_onto_the_callers_shardings(tmp_path):
    """What eval and export restore: the params, laid out as the caller asks (here on another
    mesh than they were saved from), from a checkpoint whose other arrays (the optimizer state
    and a reference) the caller need not know the layout of."""
    saved_on = sharding_lib.make_mesh(jax.devices(), 4, 2)
    params = nnx.state(sharding_lib.shard_model(create(CONFIG, seed=1), saved_on), nnx.Param)
    expected = [np.asarray(leaf) for leaf in jax.tree.leaves(params)]
    reference = nnx.state(sharding_lib.shard_model(create(CONFIG, seed=3), saved_on), nnx.Param)
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "reference": reference}
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(5, train_state=state, data_iterator=None, meta={})
    ckpt.close()

    wanted_on = sharding_lib.make_mesh(jax.devices()[:2], 1, 2)
    like = nnx.state(sharding_lib.shard_model(create(CONFIG, seed=2), wanted_on), nnx.Param)
    fresh = Checkpointer(str(tmp_path))
    restored = fresh.restore_params(5, like)
    fresh.close()
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    leaves = jax.tree.leaves(restored)
    for got, want, target in zip(leaves, expected, jax.tree.leaves(like), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding == target.sharding


def test_keeps_only_the_newest_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # a relative directory, as `--workdir=runs/x` gives
    ckpt = Checkpointer(tmp_path.name, keep=2, async_save=False)
    tree = {"w": jnp.ones(3)}
    for step in (1, 2, 3):
        ckpt.save(step, train_state=tree, data_iterator=None, meta={"step": step})
    ckpt.close()
    assert Checkpointer(str(tmp_path)).latest_step() == 3
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]


def test_skips_step_directories_orbax_never_finished(tmp_path):
    """An interrupted copy of a workdir can hold a numbered step without orbax's commit marker:
    taking it as the newest made the resume die with a bare KeyError. The newest finished step
    is used instead, and saving that step number again replaces the unfinished directory."""
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    for step in (1, 2):
        ckpt.save(step, train_state={"w": jnp.full(3, step)}, data_iterator=None, meta={"s": step})
    ckpt.close()
    shutil.copytree(tmp_path / "2", tmp_path / "3")
    for marker in ("commit_success.txt", "_CHECKPOINT_METADATA"):
        (tmp_path / "3" / marker).unlink()
    (tmp_path / "4").mkdir()

    fresh = Checkpointer(str(tmp_path), async_save=False)
    assert fresh.latest_step() == 2
    assert fresh.read_meta(2) == {"s": 2}
    fresh.save(3, train_state={"w": jnp.full(3, 3)}, data_iterator=None, meta={"s": 3})
    fresh.close()
    assert Checkpointer(str(tmp_path)).read_meta(3) == {"s": 3}


def test_an_unreadable_step_is_named_in_the_error(tmp_path):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(5, train_state={"w": jnp.ones(3)}, data_iterator=None, meta={"s": 5})
    ckpt.close()
    (tmp_path / "5" / "meta" / "metadata").write_text("{trunc")
    fresh = Checkpointer(str(tmp_path))
    with pytest.raises(ValueError, match=str(tmp_path / "5")):
        fresh.read_meta(5)
    with pytest.raises(ValueError, match=str(tmp_path / "5")):
        fresh.restore(5, train_state_like={"w": jnp.ones(3)}, data_iterator=None)
