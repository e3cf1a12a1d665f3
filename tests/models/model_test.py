"""The decoder's KV-cache path and MoE statistics against brute-force recomputation."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import print_saved_residuals
from tiny_models import DENSE, MOE

from dora_jax.models import REMAT_POLICIES, Functional, KVCache, create


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_cached_prefill_then_decode_equals_full_forward(config):
    model = create(config, seed=1)
    fn, params = Functional.of(model)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 50, (3, 12)), jnp.int32)
    full = np.asarray(fn.logits(params, ids))
    cache = KVCache.zeros(config, 3, 16, jnp.float32)
    prefix = 7
    positions = jnp.broadcast_to(jnp.arange(prefix), (3, prefix))
    out = fn.forward(params, ids[:, :prefix], positions, cache)
    np.testing.assert_allclose(out.logits, full[:, :prefix], atol=1e-5)
    cache = out.cache
    for t in range(prefix, 12):
        step = fn.forward(params, ids[:, t : t + 1], jnp.full((3, 1), t), cache)
        cache = step.cache
        np.testing.assert_allclose(step.logits[:, 0], full[:, t], atol=1e-5)


def test_slots_at_different_positions_decode_independently():
    """One decode call with each row at its own position equals per-row full forwards."""
    model = create(DENSE, seed=2)
    fn, params = Functional.of(model)
    rng = np.random.RandomState(1)
    lengths = [3, 9, 5]
    seqs = [rng.randint(0, 50, n + 1) for n in lengths]
    cache = KVCache.zeros(DENSE, 3, 16, jnp.float32)
    for row, seq in enumerate(seqs):  # prefill each row into its own cache row
        n = lengths[row]
        single = jax.tree.map(lambda x, r=row: x[r : r + 1], cache)
        out = fn.forward(params, jnp.asarray(seq[None, :n]), jnp.arange(n)[None], single)
        cache = jax.tree.map(lambda x, y, r=row: x.at[r].set(y[0]), cache, out.cache)
    last = jnp.asarray([[s[-1]] for s in seqs])
    step = fn.forward(params, last, jnp.asarray([[n] for n in lengths]), cache)
    for row, seq in enumerate(seqs):
        ref = np.asarray(fn.logits(params, jnp.asarray(seq[None])))[0, -1]
        np.testing.assert_allclose(step.logits[row, 0], ref, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 24))
def test_expert_load_counts_match_router_top_k(seed, tokens):
    model = create(MOE, seed=seed % 7)
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, 50, (1, tokens)), jnp.int32)
    out = model.forward(ids, jnp.arange(tokens)[None])
    assert out.expert_load.shape == (2, MOE.num_experts)
    # Every token picks exactly k distinct experts in every MoE layer.
    np.testing.assert_array_equal(out.expert_load.sum(axis=1), [tokens * 2, tokens * 2])


def test_weighted_expert_load_of_a_padded_batch_is_that_of_its_sequences():
    """`load_weights` 0 on padding (and on whatever else should not count) gives the load the
    real tokens alone give, sequence by sequence, without padding (causal attention: padding
    at the end does not change the positions before it)."""
    model = create(MOE, seed=2)
    rng = np.random.RandomState(0)
    lengths = [5, 9, 2]
    seqs = [rng.randint(0, 50, n) for n in lengths]
    padded = np.zeros((3, 9), np.int32)
    weights = np.zeros((3, 9), np.float32)
    for row, seq in enumerate(seqs):
        padded[row, : len(seq)] = seq
        weights[row, : len(seq)] = 1.0
        weights[row, 0] = 0.5  # weights are weights, not just a mask
    positions = jnp.broadcast_to(jnp.arange(9), padded.shape)
    got = model.forward(jnp.asarray(padded), positions, load_weights=jnp.asarray(weights))
    want = 0.0
    for seq in seqs:
        alone = model.forward(jnp.asarray(seq[None]), jnp.arange(len(seq))[None])
        first = model.forward(jnp.asarray(seq[None, :1]), jnp.arange(1)[None])
        want = want + alone.expert_load - 0.5 * first.expert_load
    np.testing.assert_allclose(got.expert_load, want, atol=1e-6)


def test_moe_matches_dense_reference_computation():
    """ragged_dot dispatch equals an explicit per-token loop over the chosen experts."""
    model = create(MOE, seed=3)
    moe = model.layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    got, _ = moe(x)
    router = np.asarray(moe.router[...])
    gate, up, down = (np.asarray(p[...]) for p in (moe.gate_proj, moe.up_proj, moe.down_proj))
    ref = np.zeros((6, 32))
    for n, tok in enumerate(np.asarray(x[0], np.float64)):
        logits = tok @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        weights = probs[top] / probs[top].sum()
        for w, e in zip(weights, top, strict=True):
            g = tok @ gate[e]
            ref[n] += w * (((g / (1 + np.exp(-g))) * (tok @ up[e])) @ down[e])
    np.testing.assert_allclose(np.asarray(got[0]), ref, atol=1e-5)


def test_logits_at_picks_one_position_per_row():
    model = create(MOE, seed=4)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 50, (3, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
    full = np.asarray(model.forward(ids, positions).logits)
    picks = jnp.asarray([8, 0, 4])
    out = model.forward(ids, positions, logits_at=picks)
    assert out.logits.shape == (3, 1, 50)
    np.testing.assert_allclose(out.logits[:, 0], full[np.arange(3), np.asarray(picks)], atol=1e-5)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_remat_keeps_less_for_the_backward_pass_and_gives_the_same_gradient(config):
    """`remat` changes what the backward pass keeps, not the math (in float32 the gradient is the
    same to rounding; in bfloat16 the recomputation rounds apart, by up to ~1e-3). Counted in JAX's
    list of saved residuals, per decoder layer (a model of 8 layers against one of 4): "full"
    keeps one array per layer (its output, the next layer's input), "dots" keeps the matmul
    outputs, fewer than everything "none" keeps."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)))
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)

    def setup(layers):
        fn, params = Functional.of(create(dataclasses.replace(config, num_layers=layers), seed=1))

        def loss(params, remat):
            logits = fn.forward(params, tokens, positions, remat=remat).logits
            return jax.nn.log_softmax(logits)[..., 3].mean()

        return fn, params, loss

    def kept(layers, remat):  # residuals the forward computes, not params or constants
        _, params, loss = setup(layers)
        out = io.StringIO()  # "f32[2,16,32] output of add from model_lib.py:267 (...)" each
        with contextlib.redirect_stdout(out):
            print_saved_residuals(functools.partial(loss, remat=remat), params)
        return [x for x in out.getvalue().splitlines() if " output of " in x]

    per_layer = {r: (len(kept(8, r)) - len(kept(4, r))) / 4 for r in REMAT_POLICIES}
    assert per_layer["full"] == 1 < per_layer["dots"] < per_layer["none"], per_layer
    fn, params, loss = setup(4)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    reference = grad(params, "none")
    for remat in ("full", "dots"):
        got = grad(params, remat)
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="remat='some'"):
        fn.forward(params, tokens, positions, remat="some")
