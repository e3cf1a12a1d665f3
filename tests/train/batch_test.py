"""Batch layout: group checks, length buckets, and target / behaviour-logprob alignment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from train_fixtures import random_batch

from dora_jax.train import batch_lib


def _samples(seed: int, mask: bool):
    rng = np.random.RandomState(seed)
    samples = random_batch(rng, 2, 4, max_prompt=5, max_response=14)
    for t in samples:
        t.behaviour_logprobs = rng.uniform(-5, 0, len(t.response_tokens)).astype(np.float32)
        t.truncated = bool(rng.rand() < 0.3)
    return samples


def _total(t) -> int:
    return len(t.prompt_tokens) + len(t.response_tokens)


def _check_rows(samples, mbs, buckets, mask):
    """Every sample in exactly one row, rows sorted by length, each micro-batch padded to the
    smallest bucket of its longest row, and each row's tokens, targets, mask and behaviour
    log-probs where a brute-force reading of the trajectory puts them."""
    real = [r for mb in mbs for r in mb.rows if r >= 0]
    assert sorted(real) == list(range(len(samples)))
    lengths = [_total(samples[r]) for r in real]
    assert lengths == sorted(lengths)  # rows sorted by length, so buckets stay tight
    for mb in mbs:
        longest = max(_total(samples[r]) for r in mb.rows if r >= 0)
        want = min([b for b in buckets if b >= longest] or [32])  # 32: 2 x the largest
        assert mb.tokens.shape[1] == want
        for i, r in enumerate(mb.rows):
            if r < 0:  # an empty row: nothing in it reaches the loss
                assert not mb.tokens[i].any() and not mb.mask[i].any()
                continue
            t = samples[r]
            seq = np.concatenate([t.prompt_tokens, t.response_tokens])
            np.testing.assert_array_equal(mb.tokens[i, : len(seq)], seq)
            assert not mb.tokens[i, len(seq) :].any()
            # Brute force: position j predicts seq[j + 1]; the loss is on response targets.
            for j in range(mb.tokens.shape[1]):
                k = j + 1 - len(t.prompt_tokens)  # index of the target in the response
                on = 0 <= k < len(t.response_tokens)
                assert mb.mask[i, j] == float(on and not (mask and t.truncated))
                if on:
                    assert mb.targets[i, j] == t.response_tokens[k]
                    assert mb.behaviour_logp[i, j] == t.behaviour_logprobs[k]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), micro=st.sampled_from([1, 2, 4, 8]), mask=st.booleans())
def test_rows_hold_prompt_response_and_aligned_behaviour(seed, micro, mask):
    samples = _samples(seed, mask)
    buckets = (4, 8, 16)
    mbs = batch_lib.micro_batches(samples, np.arange(8), buckets, mask, size=micro)
    assert all(len(mb.rows) == micro and (mb.rows >= 0).all() for mb in mbs)
    _check_rows(samples, mbs, buckets, mask)
    np.testing.assert_array_equal(
        batch_lib.loss_lengths(samples, mask),
        [0 if (mask and t.truncated) else len(t.response_tokens) for t in samples],
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    budget=st.integers(1, 80),
    mask=st.booleans(),
    fsdp=st.sampled_from([1, 2, 4]),
)
def test_a_token_budget_packs_rows_greedily_within_it_in_powers_of_two(seed, budget, mask, fsdp):
    samples = _samples(seed, mask)
    buckets = (4, 8, 16)
    mbs = batch_lib.micro_batches(
        samples, np.arange(8), buckets, mask, tokens=budget, min_rows=fsdp
    )
    _check_rows(samples, mbs, buckets, mask)

    def fits(n: int, width: int) -> bool:  # n rows in a power-of-two micro-batch of `width`
        return n == 1 or (1 << (n - 1).bit_length()) * width <= budget

    for k, mb in enumerate(mbs):
        real = [r for r in mb.rows if r >= 0]
        b, width = mb.tokens.shape
        # Padded to the next power of two, and to one row per fsdp device at least.
        assert b == max(1 << (len(real) - 1).bit_length(), fsdp)
        assert list(mb.rows[: len(real)]) == real and (mb.rows[len(real) :] == -1).all()
        assert fits(len(real), width)  # within the budget, or a longer row alone
        if k + 1 < len(mbs):  # greedy: the next row could not have joined this micro-batch
            nxt = mbs[k + 1].rows[0]
            grown = batch_lib.bucket_length(_total(samples[nxt]), buckets)
            assert not fits(len(real) + 1, grown)


def test_long_sequences_round_up_to_a_multiple_of_the_largest_bucket():
    assert batch_lib.bucket_length(3, (4, 8)) == 4
    assert batch_lib.bucket_length(8, (4, 8)) == 8
    assert batch_lib.bucket_length(9, (4, 8)) == 16
    assert batch_lib.bucket_length(17, (4, 8)) == 24


def test_group_batch_orders_groups_and_refuses_incomplete_ones():
    samples = random_batch(np.random.RandomState(0), 3, 2)
    shuffled = [samples[i] for i in (5, 0, 3, 2, 4, 1)]
    ordered = batch_lib.group_batch(shuffled, 6, 2)
    assert [t.key for t in ordered] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="exactly tbs=8"):
        batch_lib.group_batch(samples, 8, 2)
    samples[1].sample_index = 2
    with pytest.raises(ValueError, match="prompt 0: group is not complete"):
        batch_lib.group_batch(samples, 6, 2)
