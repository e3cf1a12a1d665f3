"""The engine against independent references: full forwards of the model, numpy sampling math."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import DENSE, MOE, VOCAB

from dora_jax.engine import (
    Engine,
    FinishReason,
    PolicyParams,
    Request,
    SamplingParams,
    StopMatcher,
    generate_all,
)
from dora_jax.models import Functional, create

WEIGHT_SCALE = 8.0

# The tests share module-scoped engines (and their compilations); one xdist worker runs them all
# rather than every worker compiling its own copies (`make test` uses --dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine_test")


def _model(config, seed=1):
    model = create(config, seed=seed)
    fn, state = Functional.of(model)
    return model, fn, state


def _engine(model, **kw):
    args = dict(max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=10)
    args.update(kw)
    return Engine(model, **args)


def _prompts(rng, lengths):
    return [rng.randint(0, VOCAB, n).tolist() for n in lengths]


class Setup:
    """A model, its functional form and params, and a 4-slot greedy-by-default engine."""

    def __init__(self, config, seed, scale=1.0):
        self.model, self.fn, self.state = _model(config, seed)
        if scale != 1.0:
            self.state = jax.tree.map(lambda x: x * scale, self.state)
            nnx.update(self.model, self.state)
        self.engine = _engine(self.model, sampling=SamplingParams.greedy())
        self.params = self.engine.load_params()


# Module-scoped so tests share the engines' compilations.
@pytest.fixture(scope="module")
def dense():
    return Setup(DENSE, seed=1)


@pytest.fixture(scope="module")
def moe():
    return Setup(MOE, seed=1)


@pytest.fixture(scope="module")
def peaked():
    """Random weights at init scale give near-uniform logits; scaled-up weights give the peaked
    distributions that make top-k / top-p cut something real."""
    return Setup(DENSE, seed=4, scale=WEIGHT_SCALE)


_REFERENCE_LENGTH = 32


def _full_logits(fn, state, seq):
    """Logits of a full (uncached) forward over `seq`, [len(seq), vocab]. Right-padding to one
    length keeps it to one compilation; causal attention makes the padding invisible."""
    padded = np.zeros((1, _REFERENCE_LENGTH), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_jitted_logits(fn)(state, jnp.asarray(padded)))[0, : len(seq)]


_JITTED = {}


def _jitted_logits(fn):
    if fn not in _JITTED:
        _JITTED[fn] = jax.jit(fn.logits)
    return _JITTED[fn]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.sum(np.exp(x[np.isfinite(x)] - m))))


def _reference_logprobs(logits, sampling: SamplingParams):
    """float64 numpy: (the policy's log-probs at the temperature, which tokens top-k and top-p
    let `sampling` draw)."""
    z = np.asarray(logits, np.float64) / sampling.temperature
    order = np.argsort(-z, kind="stable")
    k = sampling.top_k or len(z)
    top = order[:k]
    probs = np.exp(_log_softmax(z[top]))
    kept, mass = np.zeros(len(z), bool), 0.0
    for index, p in zip(top, probs, strict=True):
        if sampling.top_p < 1 and kept.any() and mass >= sampling.top_p:
            break
        kept[index] = True
        mass += p
    return _log_softmax(z), kept


# ---------------------------------------------------------------------------------------------
# Greedy and log-probs against full forwards
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["dense", "moe"])
def test_greedy_equals_repeated_argmax_of_full_forward(setup, request):
    s = request.getfixturevalue(setup)
    rng = np.random.RandomState(0)
    prompts = _prompts(rng, [3, 9, 1, 16, 5, 2])  # 6 requests through 4 slots: refills happen
    requests = [
        Request(prompt_tokens=p, max_new_tokens=7, ignore_eos=True, id=i)
        for i, p in enumerate(prompts)
    ]
    completions = generate_all(s.engine, s.params, requests)
    for prompt, completion in zip(prompts, completions, strict=True):
        seq = list(prompt)
        want_logprobs = []
        for _ in range(7):
            logits = _full_logits(s.fn, s.state, seq)[-1]
            seq.append(int(np.argmax(logits)))
            want_logprobs.append(_log_softmax(logits)[seq[-1]])
        assert completion.tokens.tolist() == seq[len(prompt) :]
        # Greedy rows report the log-prob under the unscaled distribution.
        np.testing.assert_allclose(completion.logprobs, want_logprobs, atol=1e-4)
        assert completion.finish_reason == "length"


def test_a_cache_shorter_than_prefill_plus_decode_gives_the_same_greedy_tokens(dense):
    """cache_length only has to hold prompt + response - 1 positions; what does not fit is
    refused up front, naming the field."""
    engine = _engine(dense.model, sampling=SamplingParams.greedy(), cache_length=20)
    params = engine.load_params()
    rng = np.random.RandomState(5)
    prompts = _prompts(rng, [16, 4, 11])
    requests = [
        Request(prompt_tokens=p, max_new_tokens=min(10, 21 - len(p)), ignore_eos=True, id=i)
        for i, p in enumerate(prompts)
    ]  # 16 + 5 and 11 + 10 use all 20 positions
    for prompt, completion in zip(prompts, generate_all(engine, params, requests), strict=True):
        seq = list(prompt)
        while len(seq) < min(21, len(prompt) + 10):
            seq.append(int(np.argmax(_full_logits(dense.fn, dense.state, seq)[-1])))
        assert completion.tokens.tolist() == seq[len(prompt) :]
    too_long = Request(prompt_tokens=prompts[0], max_new_tokens=6, ignore_eos=True, id="x")
    with pytest.raises(ValueError, match="needs 21 KV positions; cache_length=20"):
        engine.prefill_requests(params, [too_long])
    with pytest.raises(ValueError, match="cache_length"):
        _engine(dense.model, cache_length=15)  # below max_prefill_length=16


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=6, top_p=0.8),
    ],
    ids=["temperature", "top_k", "top_p", "top_k_top_p"],
)
def test_logprobs_equal_teacher_forced_forward(peaked, sampling):
    rng = np.random.RandomState(1)
    prompts = _prompts(rng, [4, 11, 2, 7, 13, 6])
    requests = [
        Request(prompt_tokens=p, sampling=sampling, max_new_tokens=10, ignore_eos=True, seed=i)
        for i, p in enumerate(prompts)
    ]
    completions = generate_all(peaked.engine, peaked.params, requests)
    cut_something = False
    for prompt, completion in zip(prompts, completions, strict=True):
        logits = _full_logits(peaked.fn, peaked.state, prompt + completion.tokens.tolist())
        n = len(prompt)
        for i, token in enumerate(completion.tokens):
            ref, kept = _reference_logprobs(logits[n - 1 + i], sampling)
            assert kept[token], "sampled a token outside the kept set"
            # The policy's log-prob, not the truncated distribution's: the trainer's.
            assert abs(completion.logprobs[i] - ref[token]) <= 1e-4
            cut_something |= not kept.all()
    if sampling.top_k or sampling.top_p < 1:
        assert cut_something, "the test model never truncated anything"


def test_sampled_tokens_follow_the_seed(dense):
    engine, params = dense.engine, dense.params
    request = Request(
        prompt_tokens=[3, 1, 4, 1, 5],
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=10,
        ignore_eos=True,
        seed=7,
    )
    (a,) = generate_all(engine, params, [request])
    (b,) = generate_all(engine, params, [request])
    (c,) = generate_all(engine, params, [dataclasses.replace(request, seed=8)])
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() != c.tokens.tolist()


# ---------------------------------------------------------------------------------------------
# Batch / slot independence
# ---------------------------------------------------------------------------------------------


def _run_slot(engine, params, ds, slot, steps):
    tokens, logprobs = [], []
    for _ in range(steps):
        ds, result = engine.generate(params, ds)
        r = result.convert_to_numpy().get_result_at_slot(slot)
        assert r.valid[0, 0]
        tokens.append(int(r.tokens[0, 0]))
        logprobs.append(float(r.log_probs[0, 0]))
    return ds, tokens, logprobs


@pytest.mark.parametrize("setup", ["dense", "moe"])
def test_request_independent_of_batch_and_slot(setup, request):
    s = request.getfixturevalue(setup)
    engine, params = s.engine, s.params
    sampling = SamplingParams(temperature=1.0, top_k=20)
    target = Request(
        prompt_tokens=[7, 8, 9, 10, 11],
        sampling=sampling,
        max_new_tokens=10,
        ignore_eos=True,
        seed=5,
    )
    rng = np.random.RandomState(3)
    others = [
        Request(prompt_tokens=p, sampling=sampling, max_new_tokens=10, ignore_eos=True, seed=50 + i)
        for i, p in enumerate(_prompts(rng, [6, 2, 8]))
    ]

    # Alone, in slot 0.
    prefix, first = engine.prefill_requests(params, [target])
    ds = engine.insert(prefix, engine.init_decode_state(), 0)
    ds, alone, alone_lp = _run_slot(engine, params, ds, 0, 8)
    alone = [int(first.tokens[0])] + alone
    alone_lp = [float(first.log_probs[0, 0])] + alone_lp

    # With other requests that started earlier, prefilled in one batch, in slot 2.
    ds = engine.init_decode_state()
    prefix, _ = engine.prefill_requests(params, others[:2])
    ds = engine.insert(prefix, ds, [3, 0])
    ds, _ = engine.generate(params, ds)
    prefix, first = engine.prefill_requests(params, [others[2], target])
    ds = engine.insert(prefix, ds, [1, 2])
    ds, shared, shared_lp = _run_slot(engine, params, ds, 2, 8)
    shared = [int(np.asarray(first.tokens)[1])] + shared
    shared_lp = [float(np.asarray(first.log_probs)[1, 0])] + shared_lp

    assert shared == alone
    np.testing.assert_allclose(shared_lp, alone_lp, atol=1e-5)


def test_generate_all_matches_one_request_at_a_time(dense):
    engine, params = dense.engine, dense.params
    rng = np.random.RandomState(4)
    sampling = SamplingParams(temperature=0.8)
    lengths = [9, 2, 6, 10, 4, 3, 7]
    requests = [
        Request(p, sampling, max_new_tokens=n, ignore_eos=True, seed=i, id=f"r{i}")
        for i, (p, n) in enumerate(zip(_prompts(rng, [5, 3, 12, 1, 8, 2, 4]), lengths, strict=True))
    ]
    together = generate_all(engine, params, requests)
    for request, completion in zip(requests, together, strict=True):
        (alone,) = generate_all(engine, params, [request])
        assert completion.id == request.id
        assert len(completion) == request.max_new_tokens
        assert completion.tokens.tolist() == alone.tokens.tolist()
        np.testing.assert_allclose(completion.logprobs, alone.logprobs, atol=1e-5)


TIED = dataclasses.replace(DENSE, architecture="Qwen2ForCausalLM", qk_norm=False,
                           attention_bias=True, tie_word_embeddings=True)  # fmt: skip


@pytest.mark.parametrize("config", [DENSE, MOE, TIED], ids=["dense", "moe", "tied"])
def test_a_bfloat16_engine_holds_bfloat16_params_and_decodes_as_with_the_float32_masters(config):
    """A bfloat16 model trains float32 master weights (`app_lib.PARAM_DTYPE`); its engine holds
    them rounded to bfloat16, half the bytes to read per decode step, and decodes as the float32
    params would: the model rounds every weight to its compute dtype where it uses it, norms,
    router and output head included (every weight is perturbed off bfloat16's grid here, the
    norms' initial 1.0 among them)."""
    model = create(config, seed=3, param_dtype=jnp.float32, dtype=jnp.bfloat16)
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, noisy))
    engine = _engine(model)
    held = engine.load_params(version=0)
    assert {x.dtype for x in held.leaves} == {np.dtype(jnp.bfloat16)}
    masters = PolicyParams(jax.device_put(nnx.state(model), engine.param_shardings), 0)
    assert {x.dtype for x in masters.leaves} == {np.dtype(np.float32)}
    rng = np.random.RandomState(0)
    requests = [Request(prompt_tokens=p, seed=i) for i, p in enumerate(_prompts(rng, [3, 7, 5]))]
    for a, b in zip(
        generate_all(engine, held, requests), generate_all(engine, masters, requests), strict=True
    ):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


# ---------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------


def test_stop_conditions(dense):
    engine, params = dense.engine, dense.params
    prompt = [5, 6, 7]
    (free_run,) = generate_all(
        engine, params, [Request(prompt_tokens=prompt, max_new_tokens=10, ignore_eos=True)]
    )
    tokens = free_run.tokens.tolist()
    eos = tokens[3]
    first_eos = tokens.index(eos)

    def run(**kw):
        (c,) = generate_all(engine, params, [Request(prompt_tokens=prompt, **kw)], **extra)
        return c

    extra = {}
    c = run(eos_ids=[eos])
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[: first_eos + 1], "eos")
    c = run(eos_ids=[eos], ignore_eos=True)
    assert (c.tokens.tolist(), c.finish_reason) == (tokens, "length")
    c = run(eos_ids=[eos], min_new_tokens=first_eos + 1)
    later = tokens.index(eos, first_eos + 1) if eos in tokens[first_eos + 1 :] else None
    if later is None:
        assert c.finish_reason == "length"
    else:
        assert (c.tokens.tolist(), c.finish_reason) == (tokens[: later + 1], "eos")
    c = run(max_new_tokens=1)
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[:1], "length")
    c = run(eos_ids=[tokens[0]])  # finished by the token prefill samples
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[:1], "eos")
    c = run(stop_sequences=[tokens[4:6]])
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[:6], "stop")
    # A match on the last token allowed is a stop (vLLM reports the same), not a length.
    c = run(stop_sequences=[tokens[4:6]], max_new_tokens=6)
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[:6], "stop")
    # Stop rules wait for min_new_tokens, like EOS: the first match ending at or after it.
    seq = tokens[4:6]
    ends = [n for n in range(7, 11) if tokens[n - 2 : n] == seq]
    c = run(stop_sequences=[seq], min_new_tokens=7, max_new_tokens=10)
    expected = (tokens[: ends[0]], "stop") if ends else (tokens, "length")
    assert (c.tokens.tolist(), c.finish_reason) == expected

    def letters(ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    extra = {"text_stream": lambda: lambda token: letters([token])}
    stop = letters(tokens[2:5])
    c = run(stop_strings=[stop])
    assert c.finish_reason == "stop" and len(c) <= 5
    assert stop in letters(c.tokens) and stop not in letters(c.tokens[:-1])

    # Engine-level default EOS ids apply to requests that carry none.
    eos_engine = _engine(dense.model, sampling=SamplingParams.greedy(), eos_ids=[eos])
    (c,) = generate_all(eos_engine, eos_engine.load_params(), [Request(prompt_tokens=prompt)])
    assert (c.tokens.tolist(), c.finish_reason) == (tokens[: first_eos + 1], "eos")


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), max_size=30),
    sequences=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=2),
    strings=st.lists(st.text("xyz", min_size=1, max_size=4), max_size=2),
    min_new_tokens=st.integers(0, 8),
)
def test_stop_matcher_stops_where_the_brute_force_rule_does(
    tokens, sequences, strings, min_new_tokens
):
    """The streaming matcher against the rule read off the whole response at every length:
    the first n >= min_new_tokens at which the response ends in a stop sequence or its text
    contains a stop string. Tokens decode to 0-2 characters, as byte-level ones can."""
    text = ["", "x", "y", "z", "xy", "zz"]
    matcher = StopMatcher(sequences, strings, min_new_tokens, lambda: lambda t: text[t])
    got = next((n for n, t in enumerate(tokens, 1) if matcher.step(t)), None)

    def stops_at(n):
        ends_in = any(tokens[:n][-len(s) :] == s for s in sequences if len(s) <= n)
        return ends_in or any(s in "".join(text[t] for t in tokens[:n]) for s in strings)

    want = next((n for n in range(1, len(tokens) + 1) if n >= min_new_tokens and stops_at(n)), None)
    assert got == want


def test_stop_strings_need_a_text_stream():
    with pytest.raises(ValueError, match="text stream"):
        StopMatcher(stop_strings=["x"])
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(stop_strings=[""], text_stream=lambda: str)


def test_free_slot_aborts_and_allows_refill(dense):
    engine, params = dense.engine, dense.params
    request = Request(prompt_tokens=[1, 2, 3], max_new_tokens=10)
    prefix, _ = engine.prefill_requests(params, [request])
    ds = engine.insert(prefix, engine.init_decode_state(), 1)
    ds, _ = engine.generate(params, ds)
    assert engine.active_slots(ds).tolist() == [False, True, False, False]
    ds = engine.free_slot(ds, 1)
    assert not engine.active_slots(ds).any()
    ds, result = engine.generate(params, ds)
    r = result.convert_to_numpy().get_result_at_slot(1)
    assert r.valid[0, 0] == 0 and r.finish_reason[0] == FinishReason.ABORTED
    prefix, _ = engine.prefill_requests(params, [request])
    ds = engine.insert(prefix, ds, 1)  # free again: no error
    assert engine.active_slots(ds)[1]


def test_admit_equals_prefill_then_insert_and_refuses_busy_slots(dense):
    """`admit` (one program) leaves the same decode state and yields the same tokens as
    `prefill_requests` then `insert`; a row aimed at a busy slot is refused and that slot's
    request decodes on untouched."""
    engine, params = dense.engine, dense.params
    sampling = SamplingParams(temperature=1.0)
    busy = Request([5, 6, 7], sampling, max_new_tokens=10, ignore_eos=True, seed=3)
    new = [
        Request([1, 2, 3, 4], sampling, max_new_tokens=10, ignore_eos=True, seed=11),
        Request([8, 9], sampling, max_new_tokens=10, ignore_eos=True, seed=12),
        Request([4, 4, 4], sampling, max_new_tokens=1, ignore_eos=True, seed=13),
    ]

    def started():
        prefix, _ = engine.prefill_requests(params, [busy])
        ds, _ = engine.generate(params, engine.insert(prefix, engine.init_decode_state(), 1))
        return ds

    ds, first = engine.admit(params, started(), new, [0, 1, 3])
    first = first.convert_to_numpy()
    assert first.valid[:3].tolist() == [True, False, True]

    taken = [new[0], new[2]]
    prefix, expected_first = engine.prefill_requests(params, taken)
    reference = engine.insert(prefix, started(), [0, 3])
    expected_first = expected_first.convert_to_numpy()
    assert first.tokens[[0, 2]].tolist() == expected_first.tokens[:2].tolist()
    np.testing.assert_allclose(first.log_probs[[0, 2]], expected_first.log_probs[:2], atol=1e-5)
    # The max_new_tokens=1 request finished at its first token: its slot stays free.
    assert first.finish_reasons[2] == FinishReason.LENGTH
    assert engine.active_slots(ds).tolist() == [True, True, False, False]
    for got, want in zip(jax.tree.leaves(ds), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for _ in range(4):
        ds, out = engine.generate(params, ds)
        reference, want = engine.generate(params, reference)
        assert out.convert_to_numpy().tokens.tolist() == want.convert_to_numpy().tokens.tolist()
    with pytest.raises(ValueError, match="2 requests for 1 slots"):
        engine.admit(params, ds, new[:2], [2])


@settings(max_examples=12, deadline=None)
@given(choices=st.lists(st.integers(0, 3), min_size=1, max_size=8))
@example(choices=[0, 1, 2, 0])  # 3 distinct prompts in 4 rows: too many to share
@example(choices=[1, 3, 1, 3, 0, 0, 1, 1])  # [3, 1] and [3, 1, 0] differ by a trailing 0
def test_requests_with_one_prompt_share_its_prefill_and_sample_on_their_own(dense, choices):
    """A GRPO group admitted together runs the model on its prompt once (on a quarter of the
    rows or fewer), and every sample's first token, log-prob and KV are still those it gets
    prefilled alone."""
    engine = _sharing_engine(dense)
    sampling = SamplingParams(temperature=1.0)
    pool = [[7, 8, 9, 10, 11], [3, 1], [7, 8, 9, 10, 12], [3, 1, 0]]  # pairs differing at the end
    requests = [
        Request(pool[c], sampling, max_new_tokens=5, ignore_eos=True, seed=100 + i)
        for i, c in enumerate(choices)
    ]
    engine.forward_rows.clear()
    ds, first = engine.admit(
        dense.params, engine.init_decode_state(), requests, range(len(choices))
    )
    first = first.convert_to_numpy()
    distinct = len(set(choices))
    rows = 1 << (len(choices) - 1).bit_length()
    if engine.forward_rows:  # traced now: a shape this engine had not compiled
        # The fewest of rows / 4^j that hold the distinct prompts.
        shared = min(
            rows // 4**j for j in range(4) if rows % 4**j == 0 and rows // 4**j >= distinct
        )
        assert engine.forward_rows == [shared]
    for slot, request in enumerate(requests):
        prefix, alone = engine.prefill_requests(dense.params, [request])
        alone = alone.convert_to_numpy()
        assert first.tokens[slot] == alone.tokens[0]
        np.testing.assert_allclose(first.log_probs[slot], alone.log_probs[0], atol=1e-5)
        for got, want in zip(ds.cache.k + ds.cache.v, prefix.cache.k + prefix.cache.v, strict=True):
            length = want.shape[2]
            np.testing.assert_allclose(np.asarray(got[slot, :, :length]), want[0], atol=1e-5)


_SHARING_ENGINES = {}


def _sharing_engine(setup):
    """An 8-slot engine that records the row count of each prefill it traces."""
    if id(setup) not in _SHARING_ENGINES:
        engine = _engine(setup.model, max_concurrent_decodes=8)
        engine.forward_rows = []
        prefill_logits = engine._prefill_logits

        def recording(state, tokens, lengths):
            engine.forward_rows.append(tokens.shape[0])
            return prefill_logits(state, tokens, lengths)

        engine._prefill_logits = recording
        _SHARING_ENGINES[id(setup)] = engine
    return _SHARING_ENGINES[id(setup)]


def test_generate_steps_matches_repeated_generate(dense):
    """Several decode steps as one program yield, step by step, the tokens, log-probs, lengths
    and finish reasons of as many `generate` calls, requests finishing part-way included; once
    every slot has finished the program stops and the steps it skipped have no valid row."""
    engine, params = dense.engine, dense.params
    sampling = SamplingParams(temperature=1.0)
    requests = [
        Request([1, 2, 3], sampling, max_new_tokens=n, ignore_eos=True, seed=20 + n)
        for n in (2, 4, 7)
    ]

    def admitted():
        ds, _ = engine.admit(params, engine.init_decode_state(), requests, [0, 1, 3])
        return ds

    ds, reference = admitted(), admitted()
    for steps in (3, 1, 5):  # 3 steps: the 2-token request finishes at the first
        ds, results = engine.generate_steps(params, ds, steps)
        results = results.convert_to_numpy()
        assert len(results) == steps
        for got in results:
            reference, want = engine.generate(params, reference)
            want = want.convert_to_numpy()
            assert got.version == want.version == params.version
            if want.valid.any():
                np.testing.assert_array_equal(got.data, want.data)
                np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-6)
            else:  # a step the program skipped: nothing decoded in `generate` either
                assert not got.valid.any()
    # The 7-token request (its first token came with the admission) finished at the 6th decode
    # step of 9, the last call's second: no valid row after it.
    assert [r.valid.any() for r in results] == [True, True, False, False, False]
    assert results[1].finish_reasons[3] == FinishReason.LENGTH
    assert engine.active_slots(ds).tolist() == [False] * 4
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        engine.generate_steps(params, ds, 0)


# ---------------------------------------------------------------------------------------------
# Versions, JetStream-shaped results, bounded compilation
# ---------------------------------------------------------------------------------------------


def test_versions_tag_prefixes_results_and_completions(dense):
    engine, state = dense.engine, dense.state
    params = engine.load_params(version=5)
    assert isinstance(params, PolicyParams) and params.version == 5
    later = engine.shard_params(state, version=6)
    prefix, first = engine.prefill(
        params=params, padded_tokens=np.asarray([4, 5, 6, 0, 0]), true_length=3
    )
    assert first.version == 5 and first.get_result_at_slot(0).version[0] == 5
    ds = engine.insert(prefix, engine.init_decode_state(), 2)
    ds, result = engine.generate(later, ds)
    r = result.convert_to_numpy().get_result_at_slot(2)
    # The slot remembers the version that prefilled it; the result, the params that sampled.
    assert (r.version[0], result.version) == (5, 6)
    assert r.tokens.shape == (1, 1) and r.valid.shape == (1, 1) and r.lengths.tolist() == [2]
    (c,) = generate_all(engine, params, [Request(prompt_tokens=[1, 2], max_new_tokens=3)])
    assert c.version == 5
    with pytest.raises(TypeError, match="PolicyParams"):
        engine.generate(state, engine.init_decode_state())


def test_prefill_accepts_jetstream_padding_and_batches(dense):
    engine, params = dense.engine, dense.params
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11, 12]]
    padded = np.zeros((2, 16), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    _, batched = engine.prefill(params=params, padded_tokens=padded, true_length=[3, 6])
    batched = batched.convert_to_numpy()
    for i, p in enumerate(prompts):
        _, single = engine.prefill(params=params, padded_tokens=np.asarray(p), true_length=len(p))
        assert int(np.asarray(single.tokens)[0]) == int(batched.tokens[i])
        np.testing.assert_allclose(np.asarray(single.log_probs)[0], batched.log_probs[i], atol=1e-5)
    assert batched.valid[:2].all()
    with pytest.raises(NotImplementedError):
        engine.prefill(params=params, existing_prefix=object(), padded_tokens=padded, true_length=3)


def test_prefill_compiles_once_per_bucket_and_row_count(dense):
    engine = _engine(dense.model, max_prefill_length=32, sampling=SamplingParams.greedy())
    assert engine.prefill_buckets == (8, 16, 32)
    params = engine.load_params()
    rng = np.random.RandomState(5)
    for n in (1, 7, 8, 9, 16, 17, 31, 32):
        for rows in (1, 2, 3):
            prompts = _prompts(rng, [n] * rows)
            for row, prompt in enumerate(prompts):
                prompt[0] = row  # distinct prompts: nothing shared, no shared-prompt program
            engine.prefill_requests(params, [Request(prompt_tokens=p) for p in prompts])
    # 3 length buckets x 3 row counts (1, 2, 4).
    assert engine._prefill_jit._cache_size() == 9


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_bad_input_raises_and_leaves_other_slots_intact(dense):
    engine, params = dense.engine, dense.params
    sampling = SamplingParams(temperature=1.0)
    requests = [
        Request([1, 2, 3], sampling, max_new_tokens=10, ignore_eos=True, seed=1),
        Request([9, 8, 7, 6], sampling, max_new_tokens=10, ignore_eos=True, seed=2),
    ]

    def run(with_errors: bool):
        prefix, _ = engine.prefill_requests(params, requests)
        ds = engine.insert(prefix, engine.init_decode_state(), [0, 1])
        out = []
        for step in range(8):
            if with_errors and step == 3:
                bad = [
                    ([], "empty prompt"),
                    (list(range(17)), "exceeds max_prefill_length"),
                    ([1, VOCAB, 2], "outside the vocabulary"),
                    ([1, -1], "outside the vocabulary"),
                ]
                for prompt, message in bad:
                    with pytest.raises(ValueError, match=message):
                        engine.prefill_requests(params, [Request(prompt_tokens=prompt)])
                with pytest.raises(ValueError, match="max_new_tokens"):
                    engine.prefill_requests(params, [Request(prompt_tokens=[1], max_new_tokens=11)])
                good, _ = engine.prefill_requests(params, [Request(prompt_tokens=[4, 4])])
                with pytest.raises(ValueError, match=r"slot\(s\) \[1\] still hold"):
                    engine.insert(good, ds, 1)
                with pytest.raises(ValueError, match="outside"):
                    engine.insert(good, ds, 4)
                with pytest.raises(ValueError, match="outside"):
                    engine.export_slot(ds, -1)
                with pytest.raises(ValueError, match="slot 1.5 is not an integer"):
                    engine.free_slot(ds, 1.5)  # int(1.5) would quietly free slot 1
                with pytest.raises(ValueError, match="steps must be a positive integer"):
                    engine.generate_steps(params, ds, 2.0)
                ds = engine.insert(good, ds, np.int64(2))  # a free slot is fine, any int type
            ds, result = engine.generate(params, ds)
            result = result.convert_to_numpy()
            out.append((result.tokens[:2].tolist(), result.log_probs[:2, 0].tolist()))
        return out

    assert run(with_errors=True) == run(with_errors=False)


def test_bad_configuration_and_sampling_values(dense):
    model = dense.model
    with pytest.raises(ValueError, match="max_concurrent_decodes"):
        _engine(model, max_concurrent_decodes=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        _engine(model, prefill_buckets=(8, 12))
    with pytest.raises(ValueError, match="eos id"):
        _engine(model, eos_ids=[VOCAB])
    for bad in (-1, 1e-38, float("inf"), float("nan")):  # 1e-38: flushed to 0 on a device
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
