"""Learning-rate schedules against their closed forms; clipping bounds the update."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dora_jax.train import TrainConfig, optimizer_lib


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_schedule_closed_form(schedule):
    config = TrainConfig(
        learning_rate=1e-3,
        warmup_steps=10,
        schedule=schedule,
        decay_steps=110,
        min_learning_rate_ratio=0.1,
    )
    fn = optimizer_lib.schedule(config)
    for step in (0, 5, 10, 40, 110, 200):
        if step < 10:
            want = 1e-3 * step / 10
        elif schedule == "constant":
            want = 1e-3
        else:
            frac = min(step - 10, 100) / 100
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        np.testing.assert_allclose(float(fn(step)), want, rtol=1e-5, err_msg=str(step))


def test_global_norm_clipping_bounds_the_first_adam_step():
    # With clipping to 1e-4 and adam_eps much larger than that, the step is ~lr * g_clipped / eps.
    config = TrainConfig(learning_rate=1.0, adam_eps=1.0, max_grad_norm=1e-4)
    tx = optimizer_lib.make(config)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([3.0, 4.0, 0.0])}
    updates, _ = tx.update(grads, tx.init(params), params)
    clipped = np.array([3.0, 4.0, 0.0]) / 5.0 * 1e-4
    np.testing.assert_allclose(
        np.asarray(updates["w"]), -clipped / (np.abs(clipped) + 1.0), rtol=1e-4
    )
    assert float(optax.tree.norm(updates)) < 1.01e-4
