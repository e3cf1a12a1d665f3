"""A rollout instance on the real engine: what it sends the engine when it re-prefills."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tiny_models import DENSE

from dora_jax.engine import Engine
from dora_jax.models import create
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
