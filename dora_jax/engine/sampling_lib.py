"""Token sampling with behaviour log-probs: greedy, temperature, top-k, top-p, per-request seed.

Everything here is per row, so one jitted call serves slots that each carry their own settings.
The sampling distribution of a row is built in the usual order (temperature, then top-k, then
top-p over what top-k kept). The returned log-prob is the policy's, `log_softmax(logits / T)` at
the sampled token, not the truncated distribution's: the trainer computes exactly that
(`loss_lib.token_logprobs`), so a sample's importance ratio is 1 until the params move. Top-k
and top-p only choose which tokens are drawn, as in verl, OpenRLHF and TRL, whose trainers
recompute log-probs at the temperature alone; with truncation the samples are not quite the
policy's, a bias those frameworks accept, and the reason the configs leave it off in RL.

The PRNG key of a token is a pure function of (request seed, token index), so a request yields
the same tokens whichever slot, batch or engine it runs in, including after a migration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# The smallest sampling temperature taken (see `SamplingParams`).
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens.

    temperature: 0 means greedy (argmax); its log-prob is then taken under the unscaled logits,
      because the point mass greedy decoding samples from would make every log-prob 0 (the
      trainer scales by 1 as well, `policy_logits`).
    top_k: keep the k most likely tokens; 0 turns it off.
    top_p: keep the smallest most-likely set whose probability reaches p (nucleus); 1 turns it
      off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # Below MIN_TEMPERATURE a float32 device may flush the temperature to 0 and sample
        # greedily while the host thinks it samples; infinity samples uniformly.
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 is off), got {self.top_p}")

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)


def token_keys(seeds: jax.Array, indices: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed), index), index = tokens generated before it."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, indices)


def policy_logits(logits: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """The logits of the policy that samples at `temperature`: `logits / temperature`, and the
    logits themselves at temperature 0 (greedy). The engine and the trainer both use it, so the
    behaviour log-prob and the trainer's agree at the same params."""
    return logits / jnp.where(jnp.asarray(temperature) > 0, temperature, 1.0)


def truncate_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`scaled` [B, V] (`policy_logits`) with -inf outside each row's top-k, then outside the
    top-p of what top-k kept; top_p [B] float32, top_k [B] int32 (0 = off). Tokens tied at a
    cut are kept or dropped together."""
    vocab = scaled.shape[-1]

    def truncate(scaled: jax.Array) -> jax.Array:
        keys = _order_keys(scaled)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        top_k_floor = _largest_threshold(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= k)
        in_top_k = keys >= top_k_floor[:, None]
        probs = jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
        mass = lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1)
        # The kept set's mass can round just below a top_p just below 1: no threshold then
        # holds, and the 0 found must not undo top-k's cut.
        top_p_floor = jnp.maximum(_largest_threshold(keys, lambda t: mass(t) >= top_p), top_k_floor)
        # top_p == 1 keeps everything top-k kept (the sum can round below 1.0 before the tail,
        # which must not cut the tail off).
        floor = jnp.where(top_p >= 1.0, top_k_floor, top_p_floor)
        return jnp.where(keys >= floor[:, None], scaled, -jnp.inf)

    # Truncation costs 64 passes over the vocabulary; skip it when no row truncates.
    truncating = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(truncating, truncate, lambda s: s, scaled)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (sign-magnitude to offset binary). -0.0 becomes
    +0.0 first: they are equal, and a cut must keep or drop tied tokens together."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest t with holds(t [B, 1]) [B] true, for a `holds` that is true at 0 and
    can only turn false as t grows: a bisection over the 32 bits of `keys` [B, V], so the
    result is exact (it is the key of some token) and needs no sort of the vocabulary."""
    rows = keys.shape[0]

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # upper middle; no uint32 overflow
        ok = holds(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    bounds = (jnp.zeros(rows, jnp.uint32), jnp.full(rows, 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, bounds)[0]


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row; returns (tokens int32 [B], behaviour log-probs float32 [B]):
    each token's log-prob under the policy, `policy_logits`, before top-k / top-p."""
    scaled = policy_logits(logits.astype(jnp.float32), temperature[:, None])
    filtered = truncate_logits(scaled, top_k, top_p)
    sampled = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    greedy = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    tokens = jnp.where(temperature <= 0, greedy, sampled)
    return tokens, _take(jax.nn.log_softmax(scaled, axis=-1), tokens)


def _take(values: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(values, index[:, None], axis=-1)[:, 0]
