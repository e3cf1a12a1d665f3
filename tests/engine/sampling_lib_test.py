"""Sampling math against a float64 numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.engine import sampling_lib


def _reference_keep(z, top_k, top_p):
    order = np.argsort(-z, kind="stable")
    top = order[: top_k or len(z)]
    p = np.exp(z[top] - z[top].max())
    p /= p.sum()
    keep = np.zeros(len(z), bool)
    mass = 0.0
    for index, pi in zip(top, p, strict=True):
        if top_p < 1 and keep.any() and mass >= top_p:
            break
        keep[index] = True
        mass += pi
    return keep


def _filter_logits(logits, temperature, top_k, top_p):
    """The logits of each row's sampling distribution, -inf outside what it keeps."""
    scaled = sampling_lib.policy_logits(logits, temperature[:, None])
    return sampling_lib.truncate_logits(scaled, top_k, top_p)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (7, 0.9)])
def test_filter_logits_keeps_the_reference_set(top_k, top_p):
    rng = np.random.RandomState(top_k + int(top_p * 10))
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 3
    temperature = np.asarray([0.5, 1.0, 2.0, 0.0, 1.0, 0.7], np.float32)
    out = _filter_logits(
        jnp.asarray(logits),
        jnp.asarray(temperature),
        jnp.full(6, top_k, jnp.int32),
        jnp.full(6, top_p, jnp.float32),
    )
    out = np.asarray(out)
    for row in range(6):
        t = temperature[row] or 1.0
        keep = _reference_keep(logits[row].astype(np.float64) / t, top_k, top_p)
        assert (np.isfinite(out[row]) == keep).all()
        np.testing.assert_allclose(out[row][keep], logits[row][keep] / t, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab=st.integers(2, 300),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
    spread=st.floats(0.1, 20.0),
)
def test_truncation_matches_the_sorted_reference(seed, vocab, top_k, top_p, spread):
    """The bisection finds exactly the set a full sort keeps, over random vocabularies,
    logit spreads (near-uniform to near-one-hot) and settings."""
    logits = np.random.RandomState(seed).normal(size=(3, vocab)).astype(np.float32) * spread
    out = _filter_logits(
        jnp.asarray(logits),
        jnp.ones(3),
        jnp.full(3, top_k, jnp.int32),
        jnp.full(3, top_p, jnp.float32),
    )
    for row in range(3):
        z = logits[row].astype(np.float64)
        top = np.sort(z)[::-1][: top_k or vocab]
        mass = np.cumsum(np.exp(top - top[0]) / np.exp(top - top[0]).sum())
        if np.abs(mass - top_p).min() < 1e-5:
            continue  # the cut is decided by float32 rounding either way
        keep = _reference_keep(z, top_k, top_p)
        assert (np.isfinite(np.asarray(out[row])) == keep).all()


def test_top_p_one_keeps_a_negligible_tail():
    logits = jnp.asarray([[0.0, -30.0, -60.0, -90.0]])
    out = _filter_logits(logits, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1))
    assert np.isfinite(np.asarray(out)).all()
    out = _filter_logits(logits, jnp.ones(1), jnp.full(1, 3, jnp.int32), jnp.ones(1))
    assert np.isfinite(np.asarray(out)).tolist() == [[True, True, True, False]]


def test_greedy_rows_take_argmax_with_unscaled_logprob():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    keys = sampling_lib.token_keys(jnp.asarray([1, 2], jnp.uint32), jnp.zeros(2, jnp.int32))
    tokens, logprobs = sampling_lib.sample(
        logits, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), keys
    )
    assert tokens.tolist() == [1, 0]
    np.testing.assert_allclose(
        logprobs, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], atol=1e-6
    )


def test_token_key_is_a_function_of_seed_and_index_only():
    a = sampling_lib.token_keys(jnp.asarray([3, 9], jnp.uint32), jnp.asarray([4, 0]))
    b = sampling_lib.token_keys(jnp.asarray([7, 7, 3], jnp.uint32), jnp.asarray([1, 1, 4]))
    data = jax.random.key_data
    np.testing.assert_array_equal(data(a[0]), data(b[2]))
    assert not np.array_equal(data(b[0]), data(a[0]))


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = sampling_lib.token_keys(jnp.arange(4000, dtype=jnp.uint32), jnp.zeros(4000, jnp.int32))
    tokens, logprobs = sampling_lib.sample(
        logits, jnp.ones(4000), jnp.zeros(4000, jnp.int32), jnp.full(4000, 0.7), keys
    )
    counts = np.bincount(np.asarray(tokens), minlength=4) / 4000
    # top_p=0.7 keeps {0.5, 0.3} renormalised to {0.625, 0.375}; the log-probs reported are
    # the policy's, which the trainer computes.
    np.testing.assert_allclose(counts, [0.625, 0.375, 0, 0], atol=0.03)
    np.testing.assert_allclose(
        np.unique(np.round(np.asarray(logprobs), 5)), np.round(np.log([0.3, 0.5]), 5)
    )


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (0, 0.3)])
def test_signed_zero_ties_are_kept_together(top_k, top_p):
    """-0.0 and +0.0 are equal logits: a cut keeps or drops them together, as any tie."""
    logits = jnp.asarray([[0.0, -0.0, -1.0, -2.0]])
    out = _filter_logits(logits, jnp.ones(1), jnp.full(1, top_k, jnp.int32), jnp.full(1, top_p))
    assert np.isfinite(np.asarray(out[0])).tolist() == [True, True, False, False]


def test_top_k_holds_when_top_p_rounds_just_below_one():
    """The float32 mass of what top-k kept can fall just short of a top_p just below 1: no
    threshold held then, and the whole vocabulary was kept."""
    logits = np.random.RandomState(0).normal(size=(512, 64)).astype(np.float32) * 3
    out = _filter_logits(
        jnp.asarray(logits),
        jnp.ones(512),
        jnp.full(512, 5, jnp.int32),
        jnp.full(512, np.nextafter(np.float32(1), np.float32(0))),
    )
    assert np.isfinite(np.asarray(out)).sum(-1).max() == 5
