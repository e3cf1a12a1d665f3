"""The trainer in a child process against the same trainer in this process (the reference)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.models import sharding_lib
from dora_jax.runtime import trainer_process_lib
from dora_jax.runtime.trainer_process_lib import TrainerProcess, TrainerSpec
from dora_jax.train import TrainConfig, Trainer
from tests.train.train_fixtures import TINY, random_batch, tiny_model

CONFIG = TrainConfig(tbs=8, group_size=4, learning_rate=1e-2, length_buckets=(8, 16))
SPEC = TrainerSpec(model=TINY, train=CONFIG, seed=3)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.fixture(scope="module")
def child():
    with TrainerProcess(SPEC) as trainer:
        yield trainer


def test_trains_and_publishes_like_the_trainer_in_this_process(child):
    reference = Trainer(tiny_model(seed=3), CONFIG, sharding_lib.make_mesh(jax.devices()[:1], 1, 1))
    child.restore(jax.device_get(reference.state))
    target = sharding_lib.param_shardings(
        reference.params, sharding_lib.make_mesh(jax.devices()[2:3], 1, 1)
    )
    rng = np.random.RandomState(0)
    for version in range(2):
        batch = random_batch(rng, 2, 4, version=version)
        ours, theirs = child.step(batch), reference.step(batch)
        assert ours.keys() == theirs.keys()
        for key in ("loss", "grad_norm", "ratio_mean", "entropy", "tokens"):
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, err_msg=key)
        published, expected = child.publish(target), reference.publish(target)
        assert published.version == expected.version == child.version == version + 1
        for a, b in zip(_leaves(published.params), _leaves(expected.params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        leaf = jax.tree.leaves(published.params)[0]
        assert leaf.sharding.device_set == {jax.devices()[2]}
    # A bfloat16 engine's copy is cast in the child: half the bytes go down the pipe.
    published = child.publish(target, dtype=jnp.bfloat16)
    expected = reference.publish(target, dtype=jnp.bfloat16)
    assert published.metrics["publish_bytes"] == expected.metrics["publish_bytes"]
    assert published.metrics["publish_bytes"] == 2 * sum(x.size for x in _leaves(expected.params))
    for a, b in zip(_leaves(published.params), _leaves(expected.params), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2)
    assert not np.allclose(_leaves(child.params)[0], _leaves(tiny_model(seed=3))[0])


def test_restore_returns_to_a_saved_state(child):
    saved = child.state
    batch = random_batch(np.random.RandomState(1), 2, 4, version=saved["version"])
    first = child.step(batch)
    child.publish()
    child.restore(saved)
    assert child.version == saved["version"]
    again = child.step(batch)
    np.testing.assert_allclose(again["loss"], first["loss"], rtol=1e-6)
    child.restore(saved)


def test_an_error_in_the_child_is_raised_with_its_type_and_the_child_goes_on(child):
    batch = random_batch(np.random.RandomState(2), 1, 4, version=child.version)  # 4, not tbs 8
    with pytest.raises(ValueError, match="8"):
        child.step(batch)
    version = child.version
    child.step(random_batch(np.random.RandomState(2), 2, 4, version=version))
    assert child.publish().version == version + 1


class _LossError(ValueError):  # a user's loss's own error type: its __init__ is not its args
    def __init__(self, name, value):
        super().__init__(f"loss {name} is {value}")


def test_an_error_that_does_not_unpickle_reaches_the_parent_as_its_text():
    """It pickled, so it was sent as it was, and the parent's `recv` raised a TypeError from
    unpickling it: the trainer's real error and its traceback were lost."""
    parent, child = multiprocessing.Pipe()
    try:
        raise _LossError("grpo", float("nan"))
    except _LossError as e:
        trainer_process_lib._report(child, e)
    ok, (error, child_traceback) = parent.recv()
    assert not ok and isinstance(error, RuntimeError)
    assert str(error) == "_LossError: loss grpo is nan"
    assert "raise _LossError" in child_traceback


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_the_child_runs_on_the_cores_it_was_given():
    core = max(os.sched_getaffinity(0))
    with TrainerProcess(dataclasses.replace(SPEC, cores=frozenset({core}))) as trainer:
        threads = os.listdir(f"/proc/{trainer._process.pid}/task")
        assert len(threads) > 1  # JAX's runtime threads too, not only the main thread
        for tid in threads:
            assert os.sched_getaffinity(int(tid)) == {core}, tid
        assert trainer.publish().version == 1  # and it computes there


def test_a_dead_child_is_reported_not_waited_for():
    trainer = TrainerProcess(SPEC)
    os.kill(trainer._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="trainer process exited"):
        trainer.step(random_batch(np.random.RandomState(3), 2, 4))
    trainer.close()


def test_a_child_that_cannot_build_its_trainer_says_why():
    with_kl = dataclasses.replace(SPEC, train=dataclasses.replace(CONFIG, kl_coef=0.1))
    with pytest.raises(ValueError, match="kl_coef.*needs a reference_model"):
        TrainerProcess(with_kl)
