"""Policy-gradient losses (a registry), truncated IS, k3 KL and loss aggregation.

A loss maps per-token current log-probs, old log-probs and advantages to a per-token objective
(to maximise), the importance ratio, and one boolean map per clip bound (for clip fractions).
`policy_loss` wraps the chosen one with the parts every loss shares: masking, truncated
importance sampling, the KL penalty, and aggregation by per-token weights.

Aggregation is expressed as per-token weights computed once per mini-batch on the host
(`sample_weights`), so that the loss of a micro-batch is a plain weighted sum: the gradients of
the micro-batches of a mini-batch add up to exactly the mini-batch gradient, whatever the mode.

The "old" log-probs of the ratio are each sample's own behaviour log-probs (the version that
generated it), so a batch mixing versions needs no special case. With TIS on they are the
training engine's log-probs under that same behaviour version, and the per-token weight
`min(pi_train_behaviour / pi_inference, C)` corrects the inference/training mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.engine import sampling_lib


class PolicyTerms(NamedTuple):
    objective: jax.Array  # [B, T] per-token objective to maximise (before TIS / KL)
    ratio: jax.Array  # [B, T] importance ratio the objective used
    clipped: dict[str, jax.Array]  # clip bound name -> bool [B, T]: the bound was active


# (logp, old_logp, advantages [B, T], mask [B, T], config) -> PolicyTerms
LossFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], PolicyTerms]

LOSSES: dict[str, LossFn] = {}

# Bounds that keep one token's extreme numbers from overflowing the loss, as verl's: a log
# ratio past +-20 (exp overflows float32 near 88, and an inf with A < 0 skips the whole update),
# and a k3 KL term past 10 (its gradient grows as exp(ref - logp)).
LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: makes `fn` selectable as `TrainConfig(loss=name)`."""

    def register(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return register


@register_loss("ppo_clip")
def ppo_clip(
    logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, config: Any
) -> PolicyTerms:
    """PPO clipped surrogate with separate bounds [1 - eps_low, 1 + eps_high] (DAPO), and for
    A < 0 the dual clip's floor `clip_ratio_c * A` (Ye et al. 2020, verl's `clip_ratio_c`)."""
    del mask
    terms = _clipped_surrogate(_bounded_exp(logp - old_logp), adv, config)
    c = config.clip_ratio_c
    if c is None:
        return terms
    floored = (adv < 0) & (terms.objective < c * adv)
    objective = jnp.where(floored, c * adv, terms.objective)
    return PolicyTerms(objective, terms.ratio, {**terms.clipped, "clip_dual": floored})


@register_loss("triplet")
def triplet(
    logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, config: Any
) -> PolicyTerms:
    """LongCat triplet clipping: A < 0 keeps the ratio in [1 - eps_neg_low, 1 + eps_neg_high]
    (the upper bound is dual-clip: a huge ratio on a bad token cannot blow up the update);
    A > 0 caps it at 1 + eps_pos_high."""
    del mask
    ratio = _bounded_exp(logp - old_logp)
    neg_low, neg_high = 1.0 - config.eps_neg_low, 1.0 + config.eps_neg_high
    pos_high = 1.0 + config.eps_pos_high
    objective = jnp.where(
        adv < 0, jnp.clip(ratio, neg_low, neg_high) * adv, jnp.minimum(ratio, pos_high) * adv
    )
    clipped = {
        "clip_neg_low": (adv < 0) & (ratio < neg_low),
        "clip_neg_high": (adv < 0) & (ratio > neg_high),
        "clip_pos_high": (adv > 0) & (ratio > pos_high),
    }
    return PolicyTerms(objective, ratio, clipped)


@register_loss("gspo")
def gspo(
    logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, config: Any
) -> PolicyTerms:
    """GSPO (token form): the ratio is the sequence's length-normalised likelihood ratio
    s = exp(mean_t(logp - old_logp)); each token carries sg(s) * exp(logp - sg(logp)), equal to
    s in value, so with seq_mean_token_mean aggregation the gradient is exactly GSPO's."""
    n = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    seq_ratio = _bounded_exp(((logp - old_logp) * mask).sum(axis=1, keepdims=True) / n)
    ratio = jax.lax.stop_gradient(seq_ratio) * jnp.exp(logp - jax.lax.stop_gradient(logp))
    return _clipped_surrogate(ratio, adv, config)


def _bounded_exp(log_ratio: jax.Array) -> jax.Array:
    """A ratio from its log, bounded to +-LOG_RATIO_BOUND first: per token or per sequence."""
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def _clipped_surrogate(ratio: jax.Array, adv: jax.Array, config: Any) -> PolicyTerms:
    """PPO's pessimistic objective min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with the
    tokens each bound clipped, for the ratio of `ppo_clip` (per token) and `gspo` (sequence)."""
    low, high = 1.0 - config.eps_low, 1.0 + config.eps_high
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
    clipped = {"clip_low": (adv < 0) & (ratio < low), "clip_high": (adv > 0) & (ratio > high)}
    return PolicyTerms(objective, ratio, clipped)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref): exp(d) - d - 1 with d = ref - logp, in
    [0, KL_BOUND] (verl's low_var_kl)."""
    d = ref_logp - logp
    return jnp.minimum(jnp.exp(d) - d - 1.0, KL_BOUND)


def token_logprobs(
    logits: jax.Array, targets: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """(log-prob of each target [B, T], entropy of each position's distribution [B, T]) under
    the policy the rollout samples from at `temperature`: the behaviour log-probs are its own,
    so a ratio against them is 1 until the params move (`sampling_lib.policy_logits`)."""
    logits = sampling_lib.policy_logits(logits, temperature)
    logz = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - logz
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = logz - (probs * logits).sum(axis=-1)
    return logp, entropy


def sample_weights(lengths: np.ndarray, aggregation: str, t_max: int | None) -> np.ndarray:
    """Per-sample weight of each loss token, for a mini-batch whose samples have `lengths` loss
    tokens (0 for a masked-out sample):

    - token_mean: 1 / total tokens (long answers weigh more, DAPO);
    - seq_mean_token_mean: 1 / (len_i * samples) (each sample weighs the same, GRPO);
    - seq_sum_over_const: 1 / (t_max * samples) (length-unbiased, Dr. GRPO).

    `samples` counts only samples with at least one loss token.
    """
    lengths = np.asarray(lengths, np.float64)
    included = lengths > 0
    n = included.sum()
    if n == 0:
        return np.zeros_like(lengths, np.float32)
    if aggregation == "token_mean":
        w = np.full_like(lengths, 1.0 / lengths.sum())
    elif aggregation == "seq_mean_token_mean":
        w = 1.0 / (np.maximum(lengths, 1.0) * n)
    elif aggregation == "seq_sum_over_const":
        w = np.full_like(lengths, 1.0 / (t_max * n))
    else:
        raise ValueError(f"aggregation {aggregation!r} is not supported")
    return np.where(included, w, 0.0).astype(np.float32)


def policy_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    weights: jax.Array,
    config: Any,
    *,
    train_behaviour_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted loss of a (micro-)batch and sums of its metrics over the loss tokens.

    Shapes: [B, T] for log-probs, `mask` (1 on loss tokens) and `weights` (from
    `sample_weights`, already zero off the mask); `advantages` [B]. Returns (loss, sums) where
    sums holds `tokens`, `ratio_sum`, `ratio_max`, one count per clip bound, and `tis_capped` /
    `kl_sum` when those are on. Values at masked positions never reach the loss or its gradient.
    `entropy` [B, T] (each position's, differentiable) enters with `config.entropy_coef`.
    """
    on = mask > 0
    old = behaviour_logp if train_behaviour_logp is None else train_behaviour_logp
    # Off the mask the ratio is exactly 1, so padding cannot produce inf * 0 = nan gradients.
    old = jnp.where(on, old, jax.lax.stop_gradient(logp))
    adv = jnp.broadcast_to(advantages[:, None], logp.shape)
    terms = LOSSES[config.loss](logp, old, adv, mask, config)
    per_token = -terms.objective
    tokens = mask.sum()
    sums: dict[str, jax.Array] = {
        "tokens": tokens,
        "ratio_sum": jnp.where(on, terms.ratio, 0.0).sum(),
        "ratio_max": jnp.where(on, terms.ratio, -jnp.inf).max(),
    }
    sums.update({name: (on & hit).sum().astype(jnp.float32) for name, hit in terms.clipped.items()})
    if train_behaviour_logp is not None:
        raw = jnp.exp(jnp.where(on, train_behaviour_logp - behaviour_logp, 0.0))
        per_token = per_token * jnp.minimum(raw, config.tis_cap)
        sums["tis_capped"] = (on & (raw > config.tis_cap)).sum().astype(jnp.float32)
    if ref_logp is not None:
        kl = jnp.where(on, k3_kl(logp, jnp.where(on, ref_logp, jax.lax.stop_gradient(logp))), 0.0)
        per_token = per_token + config.kl_coef * kl
        sums["kl_sum"] = kl.sum()
    if entropy is not None and config.entropy_coef:
        per_token = per_token - config.entropy_coef * jnp.where(on, entropy, 0.0)
    loss = jnp.where(on, per_token * weights, 0.0).sum()
    return loss, sums
