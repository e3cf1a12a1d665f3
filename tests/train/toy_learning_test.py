"""A real learning check: the trainer raises a tiny policy's reward on a fixed toy task.

Reward = fraction of response tokens equal to TARGET. Samples come from the policy's own
published params through a jitted sampling loop that records behaviour log-probs, and every
other iteration trains on a mix of the current and the previous version (staleness 1), as
DORA's multi-version rollout produces.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from train_fixtures import TINY, sample_groups, tiny_model

from dora_jax.models import Functional, sharding_lib
from dora_jax.train import TrainConfig, Trainer

TARGET = 3
ITERATIONS = 30


def test_trainer_raises_the_toy_reward():
    config = TrainConfig(
        tbs=32,
        group_size=8,
        mini_batches=2,
        micro_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=2,
        length_buckets=(16,),
        max_staleness=1,
    )
    mesh = sharding_lib.make_mesh(jax.devices()[:2], 2, 1)
    trainer = Trainer(tiny_model(), config, mesh)
    fn, _ = Functional.of(tiny_model())
    rng = np.random.RandomState(0)
    key = jax.random.key(0)
    first_pub = trainer.publish()  # version 1: the initial params
    published = {first_pub.version: first_pub.params}
    versions = [first_pub.version]
    rewards, seconds = [], []
    for _ in range(ITERATIONS):
        batch = []
        for g in range(config.tbs // config.group_size):
            # Half the groups come from the previous version when there is one.
            v = versions[-2] if (g % 2 and len(versions) > 1) else versions[-1]
            key, sub = jax.random.split(key)
            prompt = rng.randint(0, TINY.vocab_size, (1, 3))
            batch += sample_groups(
                fn, published[v], prompt, config.group_size, 8, v, sub, first_prompt_id=g
            )
        for t in batch:
            t.reward = float(np.mean(t.response_tokens == TARGET))
        start = time.perf_counter()
        metrics = trainer.step(batch)
        seconds.append(time.perf_counter() - start)
        assert metrics["skipped_this_step"] == 0
        pub = trainer.publish()
        published = {versions[-1]: published[versions[-1]], pub.version: pub.params}
        versions.append(pub.version)
        rewards.append(metrics["reward_mean"])
    print(f"toy rewards {np.round(rewards, 3)}; step seconds median {np.median(seconds[2:]):.4f}")
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert first < 0.2  # about 1 / vocab_size at random init
    assert last > first + 0.3, rewards
