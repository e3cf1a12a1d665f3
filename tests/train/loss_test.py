"""Policy losses, TIS, KL and aggregation against plain numpy / python re-implementations."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.train import TrainConfig, loss_lib

CFG = dict(eps_low=0.2, eps_high=0.28, eps_neg_low=0.1, eps_neg_high=0.5, eps_pos_high=0.3)


def _bounded_exp(log_ratio):
    """verl's bound on a log ratio before exp: +-20."""
    return math.exp(min(max(log_ratio, -20.0), 20.0))


def _objective(name, lp, old, a, row_lp, row_old, row_mask, c):
    """One token's objective, written out from the papers' formulas."""
    if name == "gspo":
        n = max(sum(row_mask), 1)
        deltas = zip(row_lp, row_old, row_mask, strict=True)
        r = _bounded_exp(sum(m * (float(x) - float(y)) for x, y, m in deltas) / n)
    else:
        r = _bounded_exp(float(lp) - float(old))
    if name == "triplet":
        if a < 0:
            return a * min(max(r, 1 - c.eps_neg_low), 1 + c.eps_neg_high), r
        return a * min(r, 1 + c.eps_pos_high), r
    clipped = min(max(r, 1 - c.eps_low), 1 + c.eps_high)
    objective = min(r * a, clipped * a)
    if name == "ppo_clip" and a < 0 and c.clip_ratio_c is not None:  # dual clip
        objective = max(objective, c.clip_ratio_c * a)
    return objective, r


def _reference(logp, beh, adv, mask, c, train_beh, ref):
    b, t = logp.shape
    old = beh if train_beh is None else train_beh
    per_row = []
    for i in range(b):
        losses = []
        for j in range(t):
            if not mask[i, j]:
                continue
            obj, _ = _objective(c.loss, logp[i, j], old[i, j], adv[i], logp[i], old[i], mask[i], c)
            loss = -obj
            if train_beh is not None:
                loss *= min(math.exp(train_beh[i, j] - beh[i, j]), c.tis_cap)
            if ref is not None:
                d = float(ref[i, j]) - float(logp[i, j])
                loss += c.kl_coef * min(math.exp(d) - d - 1, 10.0)  # k3, bounded as verl's
            losses.append(loss)
        per_row.append(losses)
    rows = [r for r in per_row if r]
    if not rows:
        return 0.0
    if c.aggregation == "token_mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if c.aggregation == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (c.t_max * len(rows))


@st.composite
def _case(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    rng = np.random.RandomState(draw(st.integers(0, 2**31 - 1)))
    logp = rng.uniform(-4, -0.01, (b, t)).astype(np.float32)
    # Behaviour log-probs from a different version per row: ratios land on both sides of
    # every clip bound.
    beh = (logp + rng.uniform(-0.6, 0.6, (b, t)) * rng.uniform(0, 1, (b, 1))).astype(np.float32)
    adv = rng.uniform(-2, 2, b).astype(np.float32)
    mask = (rng.uniform(size=(b, t)) < draw(st.sampled_from([0.5, 0.9, 1.0]))).astype(np.float32)
    if draw(st.booleans()):  # a few extreme tokens: past the dual clip and the ratio's bound
        far = rng.uniform(size=(b, t)) < 0.3
        beh = np.where(far, logp - rng.choice([2.0, 25.0], (b, t)), beh).astype(np.float32)
    tis = draw(st.booleans())
    kl = draw(st.booleans())
    config = TrainConfig(
        loss=draw(st.sampled_from(["ppo_clip", "triplet", "gspo"])),
        aggregation=draw(
            st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_sum_over_const"])
        ),
        t_max=11,
        tis_cap=2.0 if tis else None,
        max_staleness=4,
        kl_coef=0.05 if kl else 0.0,
        clip_ratio_c=draw(st.sampled_from([None, 3.0, 1.5])),
        **CFG,
    )
    train_beh = (beh + rng.normal(0, 0.5, (b, t))).astype(np.float32) if tis else None
    ref = (logp + rng.normal(0, 2.0, (b, t))).astype(np.float32) if kl else None  # k3 past 10
    return logp, beh, adv, mask, config, train_beh, ref


def _loss(logp, beh, adv, mask, config, train_beh, ref):
    weights = mask * loss_lib.sample_weights(mask.sum(1), config.aggregation, config.t_max)[:, None]
    as_j = lambda x: None if x is None else jnp.asarray(x)
    return loss_lib.policy_loss(
        jnp.asarray(logp),
        jnp.asarray(beh),
        jnp.asarray(adv),
        jnp.asarray(mask),
        jnp.asarray(weights),
        config,
        train_behaviour_logp=as_j(train_beh),
        ref_logp=as_j(ref),
    )


@settings(max_examples=80, deadline=None)
@given(case=_case())
def test_policy_loss_matches_reference(case):
    logp, beh, adv, mask, config, train_beh, ref = case
    loss, sums = _loss(*case)
    want = _reference(logp, beh, adv, mask, config, train_beh, ref)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4, atol=1e-5)
    assert float(sums["tokens"]) == mask.sum()
    # Ratio statistics over the loss tokens only.
    old = beh if train_beh is None else train_beh
    ratios = [
        _objective(config.loss, logp[i, j], old[i, j], adv[i], logp[i], old[i], mask[i], config)[1]
        for i, j in zip(*np.nonzero(mask), strict=True)
    ]
    np.testing.assert_allclose(float(sums["ratio_sum"]), sum(ratios), rtol=1e-4, atol=1e-5)
    if ratios:
        np.testing.assert_allclose(float(sums["ratio_max"]), max(ratios), rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(case=_case())
def test_clip_counts_match_reference(case):
    logp, beh, adv, mask, config, train_beh, _ = case
    _, sums = _loss(*case)
    old = beh if train_beh is None else train_beh
    bounds = {
        "ppo_clip": {
            "clip_low": (-1, 1 - config.eps_low),
            "clip_high": (1, 1 + config.eps_high),
            **({} if config.clip_ratio_c is None else {"clip_dual": (-2, config.clip_ratio_c)}),
        },
        "gspo": {"clip_low": (-1, 1 - config.eps_low), "clip_high": (1, 1 + config.eps_high)},
        "triplet": {
            "clip_neg_low": (-1, 1 - config.eps_neg_low),
            "clip_neg_high": (-2, 1 + config.eps_neg_high),
            "clip_pos_high": (1, 1 + config.eps_pos_high),
        },
    }[config.loss]
    assert set(bounds) <= set(sums)
    for name, (kind, bound) in bounds.items():
        count = 0
        for i, j in zip(*np.nonzero(mask), strict=True):
            args = (logp[i, j], old[i, j], adv[i], logp[i], old[i], mask[i], config)
            r = _objective(config.loss, *args)[1]
            if abs(r - bound) < 1e-5:
                pytest.skip("ratio on a clip boundary; float32 vs float64 may disagree")
            a = adv[i]
            hit = (
                (a < 0 and r < bound)
                if kind == -1
                else (a < 0 and r > bound)
                if kind == -2
                else (a > 0 and r > bound)
            )
            count += hit
        assert float(sums[name]) == count, name


def test_fully_masked_batch_has_zero_loss_and_finite_gradient():
    logp = jnp.full((2, 3), -1.0)
    config = TrainConfig(kl_coef=0.1, tis_cap=2.0, max_staleness=1)
    zeros = jnp.zeros((2, 3))

    def f(lp):
        return loss_lib.policy_loss(
            lp,
            zeros + 50.0,
            jnp.ones(2),
            zeros,
            zeros,
            config,
            train_behaviour_logp=zeros - 50.0,
            ref_logp=zeros + 80.0,
        )[0]

    assert float(f(logp)) == 0.0
    assert np.isfinite(np.asarray(jax.grad(f)(logp))).all()


def test_gspo_gradient_is_the_sequence_level_gradient():
    """GSPO's token form with seq-mean aggregation has the gradient of the sequence objective
    -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old)); checked against
    central differences of that objective in float64."""
    rng = np.random.RandomState(3)
    b, t = 3, 5
    logp = rng.uniform(-3, -0.1, (b, t))
    old = logp + rng.uniform(-0.01, 0.01, (b, t))  # ratios well inside the clip range
    adv = np.array([1.0, -0.5, 2.0])
    mask = np.ones((b, t))
    mask[1, 3:] = 0
    config = TrainConfig(loss="gspo", aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2)

    def seq_objective(lp):
        out = 0.0
        for i in range(b):
            n = mask[i].sum()
            s = np.exp(((lp[i] - old[i]) * mask[i]).sum() / n)
            out -= min(s * adv[i], np.clip(s, 0.8, 1.2) * adv[i])
        return out / b

    numeric = np.zeros_like(logp)
    for i in range(b):
        for j in range(t):
            e = np.zeros_like(logp)
            e[i, j] = 1e-5
            numeric[i, j] = (seq_objective(logp + e) - seq_objective(logp - e)) / 2e-5
    grad = jax.grad(lambda lp: _loss(lp, old, adv, mask, config, None, None)[0])(
        jnp.asarray(logp, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(grad) * mask, numeric, atol=1e-4)


def test_sample_weights_modes():
    lengths = np.array([2, 0, 4])
    np.testing.assert_allclose(
        loss_lib.sample_weights(lengths, "token_mean", None), [1 / 6, 0, 1 / 6]
    )
    np.testing.assert_allclose(
        loss_lib.sample_weights(lengths, "seq_mean_token_mean", None), [1 / 4, 0, 1 / 8]
    )
    np.testing.assert_allclose(
        loss_lib.sample_weights(lengths, "seq_sum_over_const", 10), [1 / 20, 0, 1 / 20]
    )
    assert not loss_lib.sample_weights(np.zeros(3), "token_mean", None).any()


def test_unknown_loss_names_the_field():
    with pytest.raises(ValueError, match=r"^train\.loss: "):
        TrainConfig(loss="ppo")
