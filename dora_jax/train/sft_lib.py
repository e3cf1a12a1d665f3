"""Supervised warm-up on demonstrations (`sft.steps`: the first phase of `dora-jax train`).

RL with a verifiable reward needs a policy that already succeeds sometimes: from a random
initialisation every sample scores 0, every group's advantage is 0 and nothing is learned. A
short next-token cross-entropy phase on demonstrations (loss on response tokens only) gets the
tiny CPU policy to a modest accuracy that RL then raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from dora_jax.models import Functional, Transformer, lora_lib, sharding_lib


def pack_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, response) pairs -> tokens [n, length] and a loss mask on response positions.

    The mask marks positions whose *next* token is a response token, so the model learns to
    produce the response given the prompt and never to predict the prompt.
    """
    tokens = np.full((len(examples), length), pad_id, np.int32)
    mask = np.zeros((len(examples), length), np.float32)
    for i, (prompt, response) in enumerate(examples):
        seq = list(prompt) + list(response)
        if len(seq) > length:
            raise ValueError(f"example {i} has {len(seq)} tokens, more than length={length}")
        tokens[i, : len(seq)] = seq
        mask[i, len(prompt) - 1 : len(seq) - 1] = 1.0
    return tokens, mask


def sequence_loss(
    fn: Functional, params: Any, tokens: jax.Array, mask: jax.Array, remat: str = "none"
) -> jax.Array:
    """Mean next-token cross-entropy over masked positions; `remat` as the RL trainer's
    (`train.remat`): long demonstrations need the same activation memory."""
    logits = fn.logits(params, tokens, remat)[:, :-1]
    targets = tokens[:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = mask[:, :-1]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class SupervisedTrainer:
    """AdamW on the sequence loss, params sharded over `mesh`, batch rows split over `fsdp` when
    it divides them (else replicated, as in the RL trainer). A LoRA model trains its adapters
    alone, as in RL (`lora_lib.trainable_filter`)."""

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        learning_rate: float,
        steps: int,
        remat: str = "none",
    ):
        self.fn, params = Functional.of(sharding_lib.shard_model(model, mesh))
        self.remat = remat
        self._trainable, self._frozen = nnx.split_state(
            params, lora_lib.trainable_filter(model), ...
        )
        warmup = max(1, steps // 10)
        schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, 2))
        self._tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, 0.9, 0.98))
        self.opt_state = self._tx.init(self._trainable)
        self._mesh = mesh
        self._step = jax.jit(self._update, donate_argnums=(0, 1))

    @property
    def params(self) -> Any:
        return nnx.merge_state(self._frozen, self._trainable)

    def _update(self, trainable, opt_state, frozen, tokens, mask):
        loss, grads = jax.value_and_grad(
            lambda t: sequence_loss(self.fn, nnx.merge_state(frozen, t), tokens, mask, self.remat)
        )(trainable)
        updates, opt_state = self._tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    def step(self, tokens: np.ndarray, mask: np.ndarray) -> float:
        data = sharding_lib.row_sharding(self._mesh, len(tokens))
        tokens, mask = jax.device_put((tokens, mask), data)
        self._trainable, self.opt_state, loss = self._step(
            self._trainable, self.opt_state, self._frozen, tokens, mask
        )
        return float(loss)

    def model(self) -> Transformer:
        return nnx.merge(self.fn.graphdef, self.params)
