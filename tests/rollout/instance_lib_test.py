"""A rollout instance on the real engine: what it sends the engine when it re-prefills, and how
a stop string ends a request inside a multi-step call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import DENSE

from dora_jax.engine import Engine, generate_all
from dora_jax.engine import Request as EngineRequest
from dora_jax.models import LoRAConfig, create
from dora_jax.rollout.instance_lib import RolloutInstance
from dora_jax.rollout.request_lib import PromptSpec, Request


def test_a_re_prefilled_request_does_not_reuse_its_first_tokens_random_draws():
    """`partial` re-prefills an interrupted request (prompt + tokens so far) and the engine
    keys token i of a prefill on (seed, i) from that prefill on. With the request's own seed
    again, its 4 next tokens were drawn with the keys of its first 4: under a uniform policy
    (all-zero weights) the continuation repeated them, a 1 in 50^4 event for independent
    draws, and its behaviour log-probs did not describe how it was sampled."""
    model = create(DENSE, seed=0)
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model)))
    engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=12)
    x = RolloutInstance(0, engine)
    x.load(0, engine.load_params(0).state)
    spec = PromptSpec(0, np.asarray([3, 7, 11], np.int32), (8,), ignore_eos=True)
    request = Request(spec, sample_index=0, seed=1234, version=0)
    x.dispatch_prefill([(request, 0)])
    x.dispatch_generate(3)
    assert x.collect()[0] == [] and len(request.tokens) == 4
    assert x.evict_all() == [request]
    x.dispatch_prefill([(request, 0)])  # as partial does after a weight update
    x.dispatch_generate(3)
    assert x.collect()[0] == [request] and len(request.tokens) == 8
    assert request.tokens[4:] != request.tokens[:4]
    assert np.allclose(request.logprobs, np.log(1 / DENSE.vocab_size), atol=1e-5)  # uniform


def test_a_stop_string_ends_a_request_mid_call_and_frees_its_slot_for_the_next():
    """A stop string completed inside a multi-step call ends the request there: its tokens and
    log-probs are the free run's up to the first token whose text contains the stop string
    (the engine keys token i on (seed, i), so the free run is the reference), and the slot
    takes a new request, which decodes as it does alone (an engine slot left decoding would
    refuse it)."""
    model = create(DENSE, seed=0)
    engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=12)
    params = engine.load_params(0)
    letters = "abcdefgh"

    def text(ids):
        return "".join(letters[i % len(letters)] for i in ids)

    prompt = np.asarray([3, 7, 11], np.int32)
    (free,) = generate_all(engine, params, [EngineRequest(prompt, max_new_tokens=12, seed=5)])
    stop = text(free.tokens[2:4])
    ends = next(n for n in range(1, 13) if stop in text(free.tokens[:n]))
    assert ends <= 4
    spec = PromptSpec(
        0, prompt, (12,), stop_strings=(stop,), text_stream=lambda: lambda t: text([t])
    )
    x = RolloutInstance(0, engine)
    x.load(0, params.state)
    request = Request(spec, sample_index=0, seed=5, version=0)
    x.dispatch_prefill([(request, 1)])
    x.dispatch_generate(8)
    finished, busy = x.collect()
    assert finished == [request] and x.free() == [0, 1] and not request.truncated
    assert request.tokens == free.tokens[:ends].tolist()
    np.testing.assert_allclose(request.logprobs, free.logprobs[:ends], atol=1e-5)
    # The first token came with the prefill; the engine ran the call's 8 steps, the slot
    # decoding for nothing after the stop until it was freed.
    assert busy == [1] * (ends - 1) + [0] * (8 - ends + 1)

    other = PromptSpec(1, np.asarray([9, 4], np.int32), (6,))
    (alone,) = generate_all(engine, params, [EngineRequest(other.tokens, max_new_tokens=6, seed=8)])
    nxt = Request(other, sample_index=0, seed=8, version=0)
    x.dispatch_prefill([(nxt, 1)])
    x.dispatch_generate(8)
    assert x.collect()[0] == [nxt]
    assert nxt.tokens == alone.tokens.tolist()


def test_a_lora_instance_moves_its_base_once_then_each_versions_adapters():
    """A LoRA version differs from the last in its adapters alone: after the first version an
    instance moves only those, and decodes what an engine holding the whole version does."""
    model = create(DENSE, seed=0, lora=LoRAConfig(rank=2))
    settings = dict(max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=8)
    x = RolloutInstance(0, Engine(model, **settings))
    v0 = x.engine.load_params(0).state
    _, first = x.load(0, v0)
    assert first == sum(a.nbytes for a in jax.tree.leaves(v0))
    rng = np.random.RandomState(0)
    flat = dict(nnx.to_flat_state(v0))
    for key, variable in flat.items():
        if key[-1] == "lora_b":  # a trained version's adapters
            flat[key] = variable.replace(jnp.asarray(rng.normal(0, 1, variable.shape), jnp.float32))
    v1 = nnx.from_flat_state(flat)
    _, later = x.load(1, v1)
    assert later == sum(a.nbytes for a in jax.tree.leaves(nnx.filter_state(v1, nnx.LoRAParam)))
    assert later < first / 5

    whole = Engine(create(DENSE, seed=0, lora=LoRAConfig(rank=2)), **settings)
    spec = PromptSpec(0, np.asarray([3, 7, 11], np.int32), (8,), ignore_eos=True)
    request = Request(spec, sample_index=0, seed=21, version=1)
    (alone,) = generate_all(whole, whole.shard_params(v1, 1), [
        EngineRequest(spec.tokens, max_new_tokens=8, ignore_eos=True, seed=request.prefill_seed())
    ])  # fmt: skip
    x.dispatch_prefill([(request, 0)])
    x.dispatch_generate(8)
    assert x.collect()[0] == [request]
    assert request.tokens == alone.tokens.tolist()
    np.testing.assert_allclose(request.logprobs, alone.logprobs, atol=1e-5)
    (base_only,) = generate_all(whole, whole.shard_params(v0, 0), [
        EngineRequest(spec.tokens, max_new_tokens=8, ignore_eos=True, seed=request.prefill_seed())
    ])  # fmt: skip
    assert base_only.tokens.tolist() != alone.tokens.tolist()  # the adapters matter here


def test_a_request_finished_earlier_in_a_read_back_that_fails_comes_back_from_fail():
    """`collect` takes finished requests out of their slots as it records rows. When a later
    row raises (here a stop string's text stream), `fail` must still hand back the request that
    had finished, with the one whose row raised, for the rollout to requeue (C2)."""
    model = create(DENSE, seed=0)
    engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=12)
    x = RolloutInstance(0, engine)
    x.load(0, engine.load_params(0).state)
    short = Request(PromptSpec(0, np.asarray([3, 7], np.int32), (2,), ignore_eos=True), 0, 1, 0)
    texts = []

    def text_of(token):
        texts.append(token)
        if len(texts) == 4:  # the long request's 4th token: decode step 3, after `short` ended
            raise RuntimeError("the text stream failed")
        return "x"

    long_spec = PromptSpec(1, np.asarray([5, 9], np.int32), (8,), ignore_eos=True,
                           stop_strings=("zzz",), text_stream=lambda: text_of)  # fmt: skip
    long = Request(long_spec, 0, 2, 0)
    x.dispatch_prefill([(short, 0), (long, 1)])
    x.dispatch_generate(6)
    with pytest.raises(RuntimeError, match="text stream failed"):
        x.collect()
    assert len(short.tokens) == 2  # it had finished
    assert sorted(r.key for r in x.fail()) == [short.key, long.key]


def test_an_instance_expecting_a_version_takes_requests_and_calls_its_engine_once_it_arrives():
    """The turn that takes a version up admits its first requests before the trainer's copy is
    back (`expect`): they take their slots at once, nothing reaches the engine (which holds
    the previous version's params until then), and `receive` places the version and enqueues
    the admissions, which then decode as under that version alone."""
    engine = Engine(
        create(DENSE, seed=0), max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=8
    )
    calls = []

    def counted(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("admit", "generate_steps", "free_slot", "export_slot", "import_slot"):
        setattr(engine, name, counted(name, getattr(engine, name)))
    x = RolloutInstance(0, engine)
    x.load(0, engine.load_params(0).state)
    v1 = create(DENSE, seed=1)  # another version: other weights
    v1_params = engine.shard_params(nnx.state(v1), 1)
    spec = PromptSpec(0, np.asarray([3, 7, 11], np.int32), (6,), ignore_eos=True)
    request = Request(spec, sample_index=0, seed=4, version=1)
    seed = request.prefill_seed()  # before it has tokens: a re-prefill draws with other keys

    x.expect(1)
    x.dispatch_prefill([(request, 1)])
    assert x.expecting and x.version == 1 and x.free() == [0] and calls == []
    with pytest.raises(RuntimeError, match="not arrived"):
        x.dispatch_generate(6)
    with pytest.raises(RuntimeError, match="not arrived"):
        x.export(1)
    assert calls == []

    x.receive(v1_params.state)
    assert not x.expecting and x.params.version == 1 and calls == ["admit"]
    x.dispatch_generate(6)
    assert x.collect()[0] == [request]
    alone, under_v0 = (
        generate_all(
            engine, p, [EngineRequest(spec.tokens, max_new_tokens=6, ignore_eos=True, seed=seed)]
        )[0]
        for p in (v1_params, engine.load_params(0))
    )
    assert request.tokens == alone.tokens.tolist()
    np.testing.assert_allclose(request.logprobs, alone.logprobs, atol=1e-5)
    assert request.token_versions == [1] * 6
    assert under_v0.tokens.tolist() != alone.tokens.tolist()  # the version placed matters
