"""Shared pieces of the trainer tests: a tiny policy, trajectories, and a sampling loop.

The sampling loop is a plain jitted autoregressive loop over the full sequence (no KV cache),
so the trainer is tested against log-probs recorded at sampling time without depending on the
generation engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.models import Functional, ModelConfig, create
from dora_jax.rollout.trajectory_lib import Trajectory

TINY = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def tiny_model(seed: int = 0):
    return create(TINY, seed=seed)


def random_batch(
    rng: np.random.RandomState,
    groups: int,
    group_size: int,
    version: int | list[int] = 0,
    max_prompt: int = 4,
    max_response: int = 10,
) -> list[Trajectory]:
    """Random prompts/responses with placeholder behaviour log-probs (tests overwrite them)."""
    out = []
    for i in range(groups * group_size):
        v = version[i] if isinstance(version, list) else version
        p, r = rng.randint(1, max_prompt + 1), rng.randint(1, max_response + 1)
        out.append(
            Trajectory(
                prompt_id=i // group_size,
                sample_index=i % group_size,
                prompt_tokens=rng.randint(0, TINY.vocab_size, p).astype(np.int32),
                response_tokens=rng.randint(0, TINY.vocab_size, r).astype(np.int32),
                behaviour_logprobs=np.full(r, -2.0, np.float32),
                version=v,
                token_versions=np.full(r, v, np.int32),
                reward=float(rng.rand()),
            )
        )
    return out


@functools.partial(jax.jit, static_argnums=(0, 3))
def _sample(fn: Functional, params, prompts: jax.Array, length: int, key: jax.Array):
    b, p = prompts.shape
    buf = jnp.concatenate([prompts, jnp.zeros((b, length), jnp.int32)], axis=1)

    def body(i, carry):
        buf, logps, key = carry
        key, sub = jax.random.split(key)
        logits = fn.logits(params, buf)
        step_logits = jax.lax.dynamic_index_in_dim(logits, p + i - 1, axis=1, keepdims=False)
        token = jax.random.categorical(sub, step_logits)
        logp = jax.nn.log_softmax(step_logits)[jnp.arange(b), token]
        buf = jax.lax.dynamic_update_index_in_dim(buf, token.astype(jnp.int32), p + i, axis=1)
        logps = logps.at[:, i].set(logp)
        return buf, logps, key

    buf, logps, _ = jax.lax.fori_loop(0, length, body, (buf, jnp.zeros((b, length)), key))
    return buf[:, p:], logps


def sample_groups(
    fn: Functional,
    params,
    prompts: np.ndarray,
    group_size: int,
    length: int,
    version: int,
    key: jax.Array,
    first_prompt_id: int = 0,
) -> list[Trajectory]:
    """G samples of `length` tokens per prompt, with their behaviour log-probs."""
    repeated = jnp.asarray(np.repeat(prompts, group_size, axis=0), jnp.int32)
    responses, logps = jax.device_get(_sample(fn, params, repeated, length, key))
    return [
        Trajectory(
            prompt_id=first_prompt_id + i // group_size,
            sample_index=i % group_size,
            prompt_tokens=np.asarray(repeated[i]),
            response_tokens=responses[i].astype(np.int32),
            behaviour_logprobs=logps[i].astype(np.float32),
            version=version,
            token_versions=np.full(length, version, np.int32),
        )
        for i in range(len(responses))
    ]
