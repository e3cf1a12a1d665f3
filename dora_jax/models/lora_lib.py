"""LoRA: low-rank adapters on the decoder's linear projections.

A targeted projection computes y = x W + (alpha / rank) (x A) B, with A [in, rank] and B
[rank, out] held as `nnx.LoRAParam`s beside the frozen kernel W. B starts at zero, so an
adapted model starts as exactly its base model. The trainer then updates the adapters alone
(`trainable_filter`): gradients, the optimizer's moments and the clip norm cover rank x (in +
out) numbers per projection instead of in x out, which is what makes RL on a large model fit
where full fine-tuning's optimizer state does not.

Engines hold the adapted model as trained (base + adapters, not merged), so a sampled token's
log-prob and the trainer's recomputation of it come from the same function (C1). Export merges:
`merged_kernel` folds each adapter into its kernel, so a saved Hugging Face directory is a plain
model any reader loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# The projections an adapter can sit on, by their Hugging Face names. MoE experts' projections
# are stacked tensors, not Linears, and keep no adapters; lm_head and the embedding are left
# out as PEFT's "all-linear" leaves them out.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Where adapters go (`targets`, Hugging Face projection names), their `rank` and their
    scale `alpha / rank`."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        # A tuple, whatever was passed: the config is part of the model's (hashed) graph.
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: choose from {list(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def init_a(key: jax.Array, din: int, rank: int, dtype: Any) -> jax.Array:
    """A's init, uniform in +-1/sqrt(din) as PEFT's (kaiming-uniform with a = sqrt(5)): x A
    keeps about the scale of x whatever `din` is."""
    bound = 1.0 / jnp.sqrt(jnp.float32(din))
    return jax.random.uniform(key, (din, rank), jnp.float32, -bound, bound).astype(dtype)


def trainable_filter(model: nnx.Module) -> Any:
    """What the trainer updates in `model`: its adapters when it was built with `lora`, else
    every param (full fine-tuning)."""
    return nnx.LoRAParam if getattr(model, "lora", None) is not None else nnx.Param


def frozen_base(params: Any) -> Any | None:
    """The frozen part of a LoRA policy's params (an nnx.State), None for a policy without
    adapters: what a holder keeps once, since every version of a run shares it."""
    if not nnx.filter_state(params, nnx.LoRAParam):
        return None
    return nnx.filter_state(params, nnx.Not(nnx.LoRAParam))


def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W + scale * A B in float32, in `kernel`'s dtype: the plain kernel that computes what the
    adapted projection does."""
    delta = scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))
    return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
