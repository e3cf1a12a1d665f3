"""The optimizer: global-norm clipping, then AdamW on a warmup + constant/cosine schedule."""

from __future__ import annotations

import optax

from dora_jax.train.config_lib import TrainConfig


def schedule(config: TrainConfig) -> optax.Schedule:
    """Learning rate per optimizer step: linear warmup from 0, then constant or cosine decay
    (to `learning_rate * min_learning_rate_ratio` at `decay_steps`)."""
    peak = config.learning_rate
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=config.warmup_steps,
            decay_steps=max(config.decay_steps, config.warmup_steps + 1),
            end_value=peak * config.min_learning_rate_ratio,
        )
    if config.warmup_steps == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, config.warmup_steps), optax.constant_schedule(peak)],
        [config.warmup_steps],
    )


def make(config: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
