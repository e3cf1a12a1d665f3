"""Batch layout: group checks, length buckets, and target / behaviour-logprob alignment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from train_fixtures import random_batch

from dora_jax.train import batch_lib


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), micro=st.sampled_from([1, 2, 4, 8]), mask=st.booleans())
def test_rows_hold_prompt_response_and_aligned_behaviour(seed, micro, mask):
    rng = np.random.RandomState(seed)
    samples = random_batch(rng, 2, 4, max_prompt=5, max_response=14)
    for t in samples:
        t.behaviour_logprobs = rng.uniform(-5, 0, len(t.response_tokens)).astype(np.float32)
        t.truncated = bool(rng.rand() < 0.3)
    buckets = (4, 8, 16)
    mbs = batch_lib.micro_batches(samples, np.arange(8), micro, buckets, mask)
    assert sorted(r for mb in mbs for r in mb.rows) == list(range(8))
    total = lambda r: len(samples[r].prompt_tokens) + len(samples[r].response_tokens)
    lengths = [total(r) for mb in mbs for r in mb.rows]
    assert lengths == sorted(lengths)  # rows sorted by length, so buckets stay tight
    for mb in mbs:
        longest = max(total(r) for r in mb.rows)
        want = min([b for b in buckets if b >= longest] or [32])  # 32: 2 x the largest
        assert mb.tokens.shape[1] == want
        for i, r in enumerate(mb.rows):
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
    np.testing.assert_array_equal(
        batch_lib.loss_lengths(samples, mask),
        [0 if (mask and t.truncated) else len(t.response_tokens) for t in samples],
    )


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
