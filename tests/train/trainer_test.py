"""Trainer behaviour on one device: ratios, versions, accumulation, skips, publish, restore."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from train_fixtures import TINY, random_batch, tiny_model

from dora_jax.engine import Engine, Request, SamplingParams, generate_all
from dora_jax.models import Functional, Transformer, create, sharding_lib
from dora_jax.models.lora_lib import LoRAConfig
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.runtime import transfer_lib
from dora_jax.train import TrainConfig, Trainer, batch_lib, trainer_lib

MESH = sharding_lib.make_mesh(jax.devices()[:1], 1, 1)
BASE = TrainConfig(tbs=8, group_size=4, learning_rate=1e-3, length_buckets=(8, 16))


def _with_behaviour(trainer, batch):
    for t, lp in zip(batch, trainer.logprobs(batch), strict=True):
        t.behaviour_logprobs = lp
    return batch


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_ratio_is_one_when_behaviour_is_the_current_policy():
    config = dataclasses.replace(BASE, micro_batch_size=2, tis_cap=2.0, max_staleness=1)
    trainer = Trainer(tiny_model(), config, MESH)
    batch = _with_behaviour(trainer, random_batch(np.random.RandomState(0), 2, 4))
    m = trainer.step(batch)
    assert abs(m["ratio_mean"] - 1) < 1e-6 and abs(m["ratio_max"] - 1) < 1e-6
    assert m["clip_fraction/clip_low"] == 0 and m["clip_fraction/clip_high"] == 0
    assert m["tis_fraction"] == 0
    assert m["tokens"] == sum(len(t.response_tokens) for t in batch)
    assert m["staleness/0"] == 8 and m["skipped_this_step"] == 0


def test_groups_whose_samples_all_scored_the_same_are_counted():
    trainer = Trainer(tiny_model(), dataclasses.replace(BASE, tbs=12), MESH)
    batch = _with_behaviour(trainer, random_batch(np.random.RandomState(5), 3, 4))
    for t, reward in zip(batch, [1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5], strict=True):
        t.reward = float(reward)
    assert trainer.step(batch)["uniform_reward_groups"] == 2 / 3


def test_each_sample_is_weighed_against_its_own_behaviour_version():
    trainer = Trainer(tiny_model(), BASE, MESH)
    rng = np.random.RandomState(1)
    batch = random_batch(rng, 2, 4, version=[0, 1] * 4)
    v0_logp = trainer.logprobs(batch)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    assert trainer.publish().version == 1
    v1_logp = trainer.logprobs(batch)
    for t, a, b in zip(batch, v0_logp, v1_logp, strict=True):
        t.behaviour_logprobs = a if t.version == 0 else b
    ratios = np.concatenate(
        [np.exp(now - t.behaviour_logprobs) for t, now in zip(batch, v1_logp, strict=True)]
    )
    assert not np.allclose(ratios, 1)  # the old version's samples really are off-policy
    m = trainer.step(batch)
    np.testing.assert_allclose(m["ratio_mean"], ratios.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_max"], ratios.max(), rtol=1e-5)
    assert (m["staleness/0"], m["staleness/1"], m["staleness_max"]) == (4, 4, 1)


def _reference_loss(fn, batch, config):
    """The PPO-clip token-mean loss written directly, with its entropy bonus: one unpadded
    forward per sample."""
    rewards = np.array([t.reward for t in batch]).reshape(-1, config.group_size)
    adv = (rewards - rewards.mean(1, keepdims=True)) / (
        rewards.std(1, ddof=1, keepdims=True) + 1e-6
    )
    adv = adv.reshape(-1)
    total = sum(len(t.response_tokens) for t in batch)

    def loss(params):
        out = 0.0
        for t, a in zip(batch, adv, strict=True):
            seq = jnp.concatenate([t.prompt_tokens, t.response_tokens])[None]
            logp = jax.nn.log_softmax(fn.logits(params, seq)[0, :-1])
            p = len(t.prompt_tokens)
            rows = p - 1 + jnp.arange(len(t.response_tokens))
            lp = logp[rows, t.response_tokens]
            r = jnp.exp(lp - t.behaviour_logprobs)
            obj = jnp.minimum(r * a, jnp.clip(r, 1 - config.eps_low, 1 + config.eps_high) * a)
            entropy = -(jnp.exp(logp[rows]) * logp[rows]).sum(-1)
            out = out - obj.sum() - config.entropy_coef * entropy.sum()
        return out / total

    return loss


def _reference_grads(model, batch, config):
    fn, params = Functional.of(model)
    return jax.jit(jax.grad(_reference_loss(fn, batch, config)))(params)


def test_update_equals_reference_gradient_with_and_without_accumulation(monkeypatch):
    # AdamW's first step is -lr * g / (|g| + eps); with eps >> |g| it is a linear function of
    # the gradient, so the parameter change exposes the gradient itself.
    config = dataclasses.replace(BASE, learning_rate=1e3, adam_eps=1e3, max_grad_norm=None)
    rng = np.random.RandomState(3)
    batch = random_batch(rng, 2, 4, max_response=12)  # lengths span both buckets
    logp = Trainer(tiny_model(), config, MESH).logprobs(batch)
    for t, lp in zip(batch, logp, strict=True):  # behaviour off the policy: some tokens clip
        t.behaviour_logprobs = (lp + rng.uniform(-0.3, 0.3, len(lp))).astype(np.float32)
    bonus = dataclasses.replace(config, entropy_coef=0.5)
    grads = {
        c.entropy_coef: _host(_reference_grads(tiny_model(), batch, c)) for c in (config, bonus)
    }
    forward = Transformer.forward
    remats = []

    def spy(self, *args, remat="none", **kwargs):  # `train.remat` reaches the model
        remats.append(remat)
        return forward(self, *args, remat=remat, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    # A token budget of 32 cuts this batch into micro-batches of 4, 2, 2 and 1 rows, the first
    # padded with an empty row: none of it may change the gradient.
    budgeted = batch_lib.micro_batches(batch, np.arange(8), config.length_buckets, False, tokens=32)
    assert len(budgeted) > 2 and any((mb.rows < 0).any() for mb in budgeted)
    for micro, tokens, remat, entropy_coef in ((None, None, "none", 0.0), (2, None, "none", 0.0),
                                               (2, None, "full", 0.0), (2, None, "none", 0.5),
                                               (2, 32, "none", 0.0)):  # fmt: skip
        variant = dataclasses.replace(config, micro_batch_size=micro, micro_batch_tokens=tokens,
                                      remat=remat, entropy_coef=entropy_coef)  # fmt: skip
        trainer = Trainer(tiny_model(), variant, MESH)
        before = _host(trainer.params)
        m = trainer.step(batch)
        assert m["clip_fraction/clip_low"] + m["clip_fraction/clip_high"] > 0
        for b, a, g in zip(before, _host(trainer.params), grads[entropy_coef], strict=True):
            want = -config.learning_rate * g / (np.abs(g) + config.adam_eps)
            np.testing.assert_allclose(a - b, want, rtol=2e-3, atol=2e-6, err_msg=str(micro))
    assert "full" in remats


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_each_epoch_is_an_adam_step_from_where_the_last_one_left_the_policy(mini_batches):
    """With `epochs` = 2 an iteration passes twice over its batch (GRPO's mu), each pass one
    optimizer step per mini-batch (here each group), each at the gradient of the params the
    step before reached, its ratios still taken against the samples' behaviour log-probs.
    Reference: optax's Adam on the loss written out directly, epochs outside, mini-batches
    inside."""
    config = dataclasses.replace(
        BASE, learning_rate=1e-2, max_grad_norm=None, epochs=2, mini_batches=mini_batches
    )
    batch = random_batch(np.random.RandomState(4), 2, 4, max_response=12)
    trainer = Trainer(tiny_model(), config, MESH)
    _with_behaviour(trainer, batch)  # on-policy: the first pass's ratios are all 1
    fn, params = Functional.of(tiny_model())
    size = len(batch) // mini_batches
    grads = [
        jax.jit(jax.grad(_reference_loss(fn, batch[m * size : (m + 1) * size], config)))
        for m in range(mini_batches)
    ]
    adam = optax.adam(config.learning_rate, config.adam_b1, config.adam_b2, config.adam_eps)
    state = adam.init(params)
    for _ in range(config.epochs):
        for grad in grads:
            updates, state = adam.update(grad(params), state, params)
            params = optax.apply_updates(params, updates)
    m = trainer.step(batch)
    for got, want in zip(_host(trainer.params), _host(params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    assert m["tokens"] == sum(len(t.response_tokens) for t in batch)  # counted once
    assert m["ratio_max"] > 1  # the second pass saw how far the first moved the policy


def test_lora_trains_the_adapters_alone_as_adam_on_the_written_out_loss():
    """A LoRA policy's step moves its adapters as optax's Adam does on the loss written out
    directly, differentiated with respect to the adapters alone; the base weights stay bit for
    bit, and the optimizer keeps two moments per adapter number, none for the base."""
    config = dataclasses.replace(BASE, learning_rate=1e-2, max_grad_norm=None, epochs=2)
    lora = LoRAConfig(rank=2, alpha=4.0)
    batch = random_batch(np.random.RandomState(5), 2, 4, max_response=12)
    trainer = Trainer(create(TINY, 0, lora=lora), config, MESH)
    _with_behaviour(trainer, batch)
    fn, params = Functional.of(create(TINY, 0, lora=lora))
    adapters, base = nnx.split_state(params, nnx.LoRAParam, ...)
    loss = _reference_loss(fn, batch, config)
    grad = jax.jit(jax.grad(lambda a: loss(nnx.merge_state(base, a))))
    adam = optax.adam(config.learning_rate, config.adam_b1, config.adam_b2, config.adam_eps)
    state = adam.init(adapters)
    for _ in range(config.epochs):
        updates, state = adam.update(grad(adapters), state, adapters)
        adapters = optax.apply_updates(adapters, updates)
    trainer.step(batch)
    got = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(trainer.params)}
    for key, value in nnx.to_flat_state(base):
        np.testing.assert_array_equal(got[key], np.asarray(value[...]), err_msg=str(key))
    start = dict(nnx.to_flat_state(params))
    for key, value in nnx.to_flat_state(adapters):
        np.testing.assert_allclose(got[key], np.asarray(value[...]), rtol=1e-3, atol=1e-5)
        # B moves in the first pass; A, whose gradient is zero while B is, in the second.
        assert not np.array_equal(got[key], np.asarray(start[key][...])), key
    adapter_bytes = sum(x.nbytes for x in _host(adapters))
    moments = [x for x in _host(trainer.state["opt_state"]) if x.ndim > 0]
    assert sum(x.nbytes for x in moments) == 2 * adapter_bytes


def test_a_token_budget_compiles_one_optimizer_update_whatever_its_micro_batch_count():
    """The number of micro-batches of a token budget varies from step to step; the optimizer
    update must not compile again for each count (it took the micro-batch losses as a list)."""
    config = dataclasses.replace(BASE, micro_batch_tokens=32)
    trainer = Trainer(tiny_model(), config, MESH)

    def step(seed: int) -> int:
        batch = random_batch(np.random.RandomState(seed), 2, 4, max_response=12)
        trainer.step(_with_behaviour(trainer, batch))
        return len(batch_lib.micro_batches(batch, np.arange(8), config.length_buckets, False,
                                           tokens=config.micro_batch_tokens))  # fmt: skip

    assert step(0) == 3
    compiled = trainer_lib._apply._cache_size()
    assert [step(1), step(2)] == [4, 4]
    assert trainer_lib._apply._cache_size() == compiled


def test_non_finite_loss_skips_the_update_bit_for_bit():
    config = dataclasses.replace(BASE, mini_batches=2)
    trainer = Trainer(tiny_model(), config, MESH)
    batch = _with_behaviour(trainer, random_batch(np.random.RandomState(3), 2, 4))
    batch[0].behaviour_logprobs[0] = np.nan  # first mini-batch only
    m = trainer.step(batch)
    assert m["skipped_this_step"] == 1 and m["skipped_updates"] == 1
    assert trainer.state["optimizer_steps"] == 1  # the second mini-step still applied
    clean = _with_behaviour(trainer, random_batch(np.random.RandomState(4), 2, 4))

    skip_all = Trainer(tiny_model(), BASE, MESH)
    bad = _with_behaviour(skip_all, random_batch(np.random.RandomState(3), 2, 4))
    bad[5].behaviour_logprobs[-1] = np.nan
    params, opt = _host(skip_all.params), _host(skip_all.state["opt_state"])
    assert skip_all.step(bad)["skipped_updates"] == 1
    after = _host(skip_all.params) + _host(skip_all.state["opt_state"])
    for a, b in zip(params + opt, after, strict=True):
        np.testing.assert_array_equal(a, b)
    skip_all.step(clean)
    assert skip_all.state["skipped_updates"] == 1 and skip_all.state["optimizer_steps"] == 1
    now = _host(skip_all.params)
    changed = [not np.array_equal(a, b) for a, b in zip(params, now, strict=True)]
    assert any(changed)


def test_steps_that_skip_every_update_stop_the_run_after_the_limit():
    """Skipping a non-finite update is the policy, but a run whose every update is skipped
    changes nothing: after `max_skipped_steps` such steps in a row the trainer stops it. A
    step with one finite update starts the count again."""
    config = dataclasses.replace(BASE, max_skipped_steps=2)
    trainer = Trainer(tiny_model(), config, MESH)
    rng = np.random.RandomState(13)

    def batch(finite: bool):
        b = _with_behaviour(trainer, random_batch(rng, 2, 4))
        if not finite:
            b[0].behaviour_logprobs[0] = np.nan
        return b

    assert trainer.step(batch(False))["skipped_this_step"] == 1
    assert trainer.step(batch(True))["skipped_this_step"] == 0  # the count starts again
    trainer.step(batch(False))
    saved = jax.device_get(trainer.state)
    with pytest.raises(FloatingPointError, match=r"2 training steps in a row.*max_skipped_steps"):
        trainer.step(batch(False))
    resumed = Trainer(tiny_model(), config, MESH)  # the count travels with the state
    resumed.restore(saved)
    with pytest.raises(FloatingPointError, match="max_skipped_steps=2"):
        resumed.step(batch(False))


def test_the_learning_rate_metric_is_the_last_applied_updates():
    """Linear warmup from 0 over 4 updates to 1e-3: a step of two mini-batches applies updates
    0 and 1, at 0 and 2.5e-4; the metric reported 5e-4, the next update's rate."""
    config = dataclasses.replace(BASE, warmup_steps=4, learning_rate=1e-3, mini_batches=2)
    trainer = Trainer(tiny_model(), config, MESH)
    rng = np.random.RandomState(14)
    rates = [trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))["learning_rate"]
             for _ in range(3)]  # fmt: skip
    np.testing.assert_allclose(rates, [2.5e-4, 7.5e-4, 1e-3], rtol=1e-6)


def test_publish_places_a_copy_on_the_target_mesh():
    trainer = Trainer(tiny_model(), BASE, MESH)
    target_mesh = sharding_lib.make_mesh(jax.devices()[2:4], 1, 2)
    target = sharding_lib.param_shardings(trainer.params, target_mesh)
    pub = trainer.publish(target)
    assert pub.version == trainer.version == 1
    leaves = jax.tree.leaves(pub.params)
    assert all(x.sharding.mesh.devices.tolist() == target_mesh.devices.tolist() for x in leaves)
    assert pub.metrics["publish_bytes"] == sum(x.size * 4 for x in leaves)
    published = _host(pub.params)
    for a, b in zip(published, _host(trainer.params), strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.step(_with_behaviour(trainer, random_batch(np.random.RandomState(5), 2, 4)))
    # The published copy survives the next step's buffer donation, unchanged.
    for a, b in zip(published, _host(pub.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_lora_version_publishes_onto_a_base_already_on_the_target_as_adapters_alone():
    """Onto a rollout instance's base (`base`), here or from a trainer in another process
    (`publish_from_host`): only the adapters are copied, and the version is the trainer's."""
    trainer = Trainer(create(TINY, 0, lora=LoRAConfig(rank=2)), BASE, MESH)
    trainer.step(_with_behaviour(trainer, random_batch(np.random.RandomState(8), 2, 4)))
    target = sharding_lib.param_shardings(
        trainer.params, sharding_lib.make_mesh(jax.devices()[2:4], 1, 2)
    )
    frozen = lambda tree: nnx.filter_state(tree, nnx.Not(nnx.LoRAParam))
    base = transfer_lib.put(frozen(trainer.params), frozen(target)).tree  # an instance's
    adapters = nnx.state(trainer.params, nnx.LoRAParam)
    host = jax.device_get(trainer.params)
    for published in (
        trainer.publish(target, base=base),
        trainer_lib.publish_from_host(lambda: (host, 2, {}), target, None, base),
    ):
        assert all(a is b for a, b in zip(jax.tree.leaves(frozen(published.params)),
                                          jax.tree.leaves(base), strict=True))  # fmt: skip
        for a, b in zip(_host(published.params), _host(trainer.params), strict=True):
            np.testing.assert_array_equal(a, b)
    published = trainer.publish(target, base=base)
    assert published.metrics["publish_bytes"] == sum(x.nbytes for x in jax.tree.leaves(adapters))


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_a_lora_version_published_on_the_training_mesh_shares_the_trainers_base(dtype):
    """Where no instance's base is at hand (generation hosts), a LoRA version stays on the
    training mesh as adapters on the trainer's frozen base, cast to the engines' dtype once:
    its copy is the adapters' bytes, and it survives the next step unchanged."""
    trainer = Trainer(create(TINY, 0, lora=LoRAConfig(rank=2)), BASE, MESH)
    rng = np.random.RandomState(9)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    frozen = lambda tree: jax.tree.leaves(nnx.filter_state(tree, nnx.Not(nnx.LoRAParam)))
    adapters = nnx.state(trainer.params, nnx.LoRAParam)
    first = trainer.publish(dtype=dtype)
    want = [x.astype(ml_dtypes.bfloat16) if dtype else x for x in _host(trainer.params)]
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    second = trainer.publish(dtype=dtype and np.dtype(dtype))  # the same dtype, spelled apart
    for a, b in zip(_host(first.params), want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(a is b for a, b in zip(frozen(first.params), frozen(second.params), strict=True))
    if dtype is None:  # the trainer's own base arrays
        assert all(
            a is b for a, b in zip(frozen(first.params), frozen(trainer.params), strict=True)
        )
    size = 2 if dtype else 4
    for published in (first, second):
        assert published.metrics["publish_bytes"] == sum(
            x.size * size for x in jax.tree.leaves(adapters)
        )


def test_an_adapters_only_publish_copies_the_adapters_alone():
    """What a training group gathers once the controller holds the base."""
    trainer = Trainer(create(TINY, 0, lora=LoRAConfig(rank=2)), BASE, MESH)
    trainer.step(_with_behaviour(trainer, random_batch(np.random.RandomState(3), 2, 4)))
    adapters = nnx.state(trainer.params, nnx.LoRAParam)
    published = trainer.publish(dtype=jnp.bfloat16, adapters_only=True)
    assert published.version == 1
    assert jax.tree.structure(published.params) == jax.tree.structure(adapters)
    for a, b in zip(_host(published.params), _host(adapters), strict=True):
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16))
    assert published.metrics["publish_bytes"] == sum(x.size * 2 for x in jax.tree.leaves(adapters))
    with pytest.raises(ValueError, match="adapters_only publishes a LoRA policy's adapters"):
        Trainer(tiny_model(), BASE, MESH).publish(adapters_only=True)


def test_a_bfloat16_publish_is_the_params_rounded_and_half_the_bytes():
    """A bfloat16 engine's copy is cast on the training mesh, before it moves; the trainer keeps
    its float32 master weights."""
    trainer = Trainer(tiny_model(), BASE, MESH)
    target = sharding_lib.param_shardings(
        trainer.params, sharding_lib.make_mesh(jax.devices()[2:4], 1, 2)
    )
    pub = trainer.publish(target, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(pub.params)
    assert pub.metrics["publish_bytes"] == sum(x.size * 2 for x in leaves)
    for a, b in zip(_host(pub.params), _host(trainer.params), strict=True):
        assert a.dtype == jnp.bfloat16 and b.dtype == np.float32
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16))  # numpy's rounding


@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=2)])
def test_restore_continues_identically(lora):
    trainer = Trainer(create(TINY, 0, lora=lora), BASE, MESH)
    rng = np.random.RandomState(6)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    trainer.publish()
    saved = jax.device_get(trainer.state)
    other = Trainer(create(TINY, 9, lora=lora), BASE, MESH)
    other.restore(saved)
    assert other.version == 1
    batch = _with_behaviour(trainer, random_batch(rng, 2, 4))
    trainer.step(batch)
    other.step(batch)
    for a, b in zip(_host(trainer.params), _host(other.params), strict=True):
        np.testing.assert_array_equal(a, b)


def _numpy_logprobs(model, batch, temperature):
    """float64: each response token's log-prob and each position's entropy under
    softmax(logits / temperature), one unpadded forward per sample."""
    fn, params = Functional.of(model)
    logps, entropies = [], []
    for t in batch:
        seq = np.concatenate([t.prompt_tokens, t.response_tokens])[None]
        z = np.asarray(fn.logits(params, jnp.asarray(seq))[0], np.float64) / temperature
        rows = len(t.prompt_tokens) - 1 + np.arange(len(t.response_tokens))
        logp = z[rows] - np.log(np.exp(z[rows]).sum(-1, keepdims=True))
        logps.append(logp[np.arange(len(rows)), t.response_tokens])
        entropies.append(-(np.exp(logp) * logp).sum(-1))
    return logps, entropies


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.6), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
     SamplingParams.greedy()],
    ids=["temperature", "truncated", "greedy"],
)  # fmt: skip
def test_samples_of_the_engine_are_on_policy_for_the_trainer_at_its_temperature(sampling):
    """The trainer trains the policy the engines sample from, softmax(logits / T): at the same
    params every ratio is 1 and nothing clips. It took T = 1 whatever the rollout's was (37% of
    tokens clipped on a fully on-policy first step at T = 0.6); top-k / top-p choose which
    tokens are drawn but the log-probs are the policy's on both sides."""
    model = tiny_model()
    engine = Engine(model, max_concurrent_decodes=8, max_prefill_length=8, max_decode_length=10,
                    mesh=MESH, sampling=sampling)  # fmt: skip
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, TINY.vocab_size, rng.randint(1, 6)).tolist() for _ in range(8)]
    requests = [Request(prompt_tokens=p, max_new_tokens=10, ignore_eos=True, seed=i)
                for i, p in enumerate(prompts)]  # fmt: skip
    completions = generate_all(engine, engine.load_params(), requests)
    batch = [
        Trajectory(prompt_id=i // 4, sample_index=i % 4, prompt_tokens=np.asarray(p, np.int32),
                   response_tokens=c.tokens, behaviour_logprobs=c.logprobs, version=0,
                   token_versions=np.zeros(len(c.tokens), np.int32), reward=float(i % 3))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]  # fmt: skip
    config = dataclasses.replace(BASE, temperature=sampling.temperature)
    trainer = Trainer(model, config, MESH)
    scale = sampling.temperature or 1.0  # greedy: the unscaled logits
    want = _numpy_logprobs(model, batch, scale)[0]
    for got, behaviour, expected in zip(trainer.logprobs(batch), batch, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
        np.testing.assert_allclose(behaviour.behaviour_logprobs, expected, atol=1e-5)
    m = trainer.step(batch)
    assert abs(m["ratio_mean"] - 1) < 1e-5 and abs(m["ratio_max"] - 1) < 1e-5
    assert m["clip_fraction/clip_low"] == m["clip_fraction/clip_high"] == 0
    if sampling.temperature not in (0, 1):  # the trainer at T = 1 would see another policy
        at_one = Trainer(tiny_model(), BASE, MESH).logprobs(batch)
        gaps = [np.abs(a - t.behaviour_logprobs).max() for a, t in zip(at_one, batch, strict=True)]
        assert max(gaps) > 0.1


def test_kl_and_entropy_are_the_policys_at_the_rollout_temperature():
    config = dataclasses.replace(BASE, kl_coef=0.1, temperature=0.5)
    trainer = Trainer(tiny_model(), config, MESH, reference_model=tiny_model(3))
    batch = _with_behaviour(trainer, random_batch(np.random.RandomState(8), 2, 4))
    logp, entropy = _numpy_logprobs(tiny_model(), batch, 0.5)
    ref = _numpy_logprobs(tiny_model(3), batch, 0.5)[0]
    k3 = [np.exp(r - p) - (r - p) - 1 for p, r in zip(logp, ref, strict=True)]
    m = trainer.step(batch)  # one mini-batch: its metrics are the params' before the update
    np.testing.assert_allclose(m["kl"], np.concatenate(k3).mean(), rtol=1e-4)
    np.testing.assert_allclose(m["entropy"], np.concatenate(entropy).mean(), rtol=1e-4)


def test_kl_to_reference():
    config = dataclasses.replace(BASE, kl_coef=0.1, mini_batches=2)
    with pytest.raises(ValueError, match="kl_coef"):
        Trainer(tiny_model(), config, MESH)
    trainer = Trainer(tiny_model(), config, MESH, reference_model=tiny_model())
    batch = _with_behaviour(trainer, random_batch(np.random.RandomState(7), 2, 4))
    first = trainer.step(batch)
    assert 0 < first["kl"] < 1e-3  # zero on mini-step 1, small after one update
    trainer.publish()
    assert trainer.step(batch)["kl"] > first["kl"]


def test_the_kl_reference_travels_with_the_state():
    """A resumed run keeps the reference it started with, not the one it was rebuilt with."""
    config = dataclasses.replace(BASE, kl_coef=0.1)
    trainer = Trainer(tiny_model(), config, MESH, reference_model=tiny_model(3))
    rng = np.random.RandomState(11)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    trainer.publish()
    saved = jax.device_get(trainer.state)
    for a, b in zip(_host(saved["reference"]), _host(Functional.of(tiny_model(3))[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed = Trainer(tiny_model(5), config, MESH, reference_model=tiny_model(5))
    resumed.restore(saved)
    batch = _with_behaviour(trainer, random_batch(rng, 2, 4, version=1))
    expected, got = trainer.step(batch), resumed.step(batch)
    np.testing.assert_allclose(got["kl"], expected["kl"], rtol=1e-6)
    assert expected["kl"] > 1e-3  # reference seed 3 against policy seed 0: far apart
    del saved["reference"]
    with pytest.raises(ValueError, match="reference"):
        resumed.restore(saved)


def test_a_lora_reference_and_tis_versions_keep_their_adapters_on_the_policys_base():
    """With LoRA the KL reference and TIS's past versions hold adapters alone, the policy's
    base standing in: the KL is that of the whole reference model (numpy's k3 over log-probs of
    a plain forward), and a reference on another base is refused."""
    lora = LoRAConfig(rank=2)
    config = dataclasses.replace(BASE, kl_coef=0.1, tis_cap=2.0, max_staleness=1)
    # Adapters of its own, at a scale of its own (alpha 64 against the policy's 16).
    reference = create(TINY, 0, lora=dataclasses.replace(lora, alpha=64.0))
    ref_fn, ref_params = Functional.of(reference)
    flat = dict(nnx.to_flat_state(ref_params))
    rng = np.random.RandomState(13)
    for key, v in flat.items():
        if key[-1] == "lora_b":
            flat[key] = v.replace(jnp.asarray(rng.normal(0, 0.5, v.shape), jnp.float32))
    nnx.update(reference, nnx.from_flat_state(flat))
    with pytest.raises(ValueError, match="share its base"):
        Trainer(
            create(TINY, 0, lora=lora), config, MESH, reference_model=create(TINY, 1, lora=lora)
        )
    trainer = Trainer(create(TINY, 0, lora=lora), config, MESH, reference_model=reference)
    batch = _with_behaviour(trainer, random_batch(rng, 2, 4))

    def logp(fn, params, t):
        seq = np.concatenate([t.prompt_tokens, t.response_tokens])[None]
        out = np.asarray(jax.nn.log_softmax(fn.logits(params, seq)[0, :-1]))
        p = len(t.prompt_tokens)
        return out[p - 1 + np.arange(len(t.response_tokens)), t.response_tokens]

    fn, policy = Functional.of(create(TINY, 0, lora=lora))
    log_ratio = np.concatenate([logp(ref_fn, nnx.state(reference), t) - logp(fn, policy, t)
                                for t in batch])  # fmt: skip
    want = np.mean(np.exp(log_ratio) - log_ratio - 1)
    assert want > 1e-3
    np.testing.assert_allclose(trainer.step(batch)["kl"], want, rtol=1e-4)
    trainer.publish()
    state = trainer.state
    adapters = len(jax.tree.leaves(nnx.state(reference, nnx.LoRAParam)))
    assert len(jax.tree.leaves(state["reference"])) == adapters
    assert [len(jax.tree.leaves(v)) for v in state["tis_history"]] == [adapters]
    for got, want in zip(_host(state["reference"]), _host(nnx.state(reference, nnx.LoRAParam)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)


def test_truncated_samples_are_masked_out():
    config = dataclasses.replace(BASE, mask_truncated=True)
    results = []
    for seed in (0, 1):
        trainer = Trainer(tiny_model(), config, MESH)
        batch = _with_behaviour(trainer, random_batch(np.random.RandomState(8), 2, 4))
        batch[2].truncated = batch[6].truncated = True
        for t in (batch[2], batch[6]):  # content of masked samples must not matter
            t.response_tokens = np.random.RandomState(seed).randint(0, 16, len(t.response_tokens))
            t.behaviour_logprobs = np.full(len(t.response_tokens), -9.0 * seed, np.float32)
        m = trainer.step(batch)
        assert m["masked_truncated"] == 2 and m["truncated_fraction"] == 2 / 8
        results.append(_host(trainer.params))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_truncated_importance_sampling_uses_the_behaviour_versions_params():
    config = dataclasses.replace(BASE, tis_cap=2.0, max_staleness=1)
    trainer = Trainer(tiny_model(), config, MESH)
    rng = np.random.RandomState(10)
    stale = random_batch(rng, 2, 4, version=0)
    v0 = trainer.logprobs(stale)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    trainer.publish()
    for t, lp in zip(stale, v0, strict=True):
        t.behaviour_logprobs = lp - 1.0  # inference engine 1 nat below training: weight e > 2
    assert trainer.step(stale)["tis_fraction"] == 1.0
    trainer.publish()
    with pytest.raises(ValueError, match="max_staleness=1"):
        trainer.step(stale)  # staleness 2 now


def test_tis_weighs_each_token_against_the_version_that_sampled_it():
    """`partial` continues a request under each new version, so one trajectory's tokens come
    from several versions (`token_versions`). TIS took every token's training-side log-prob
    from the first token's version: on the later tokens its weight measured two policies'
    difference, not the engine's mismatch. Here the behaviour log-probs are exactly each
    token's own version's, so every weight is 1 and a cap just above 1 must never act."""
    config = dataclasses.replace(BASE, learning_rate=5e-2, tis_cap=1.01, max_staleness=1)
    trainer = Trainer(tiny_model(), config, MESH)
    rng = np.random.RandomState(13)
    batch = random_batch(rng, 2, 4, version=0, max_response=12)
    v0_logp = trainer.logprobs(batch)
    trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4)))
    trainer.publish()
    v1_logp = trainer.logprobs(batch)
    assert max(np.abs(a - b).max() for a, b in zip(v0_logp, v1_logp, strict=True)) > 0.1
    for t, a, b in zip(batch, v0_logp, v1_logp, strict=True):
        half = len(t.response_tokens) // 2  # interrupted here, continued under version 1
        t.token_versions = np.asarray([0] * half + [1] * (len(a) - half), np.int32)
        t.behaviour_logprobs = np.concatenate([a[:half], b[half:]])
    assert trainer.step(batch)["tis_fraction"] == 0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_restored_trainer_keeps_tis_past_versions(max_staleness):
    """A checkpoint barrier leaves samples of versions up to K old in the queue, and TIS weighs
    each against its own version's params: a trainer restored at version 2 must train v1 (and
    v0 for K = 2) samples exactly as the uninterrupted one does. It used to keep only the
    current version and raise 'no params kept for version 0' on the first such batch."""
    config = dataclasses.replace(BASE, tis_cap=2.0, max_staleness=max_staleness)
    trainer = Trainer(tiny_model(0), config, MESH)
    rng = np.random.RandomState(12)
    stale = {v: random_batch(rng, 2, 4, version=v) for v in (0, 1)}
    for version in (0, 1):
        _with_behaviour(trainer, stale[version])
        for t in stale[version]:
            t.behaviour_logprobs = t.behaviour_logprobs - 1.0  # weight e > cap: TIS acts
        trainer.step(_with_behaviour(trainer, random_batch(rng, 2, 4, version=version)))
        trainer.publish()
    saved = jax.device_get(trainer.state)
    resumed = Trainer(tiny_model(7), config, MESH)
    resumed.restore(saved)
    batch = stale[0] if max_staleness == 2 else stale[1]
    expected, got = trainer.step(batch), resumed.step(batch)
    assert got["tis_fraction"] == expected["tis_fraction"] > 0
    for a, b in zip(_host(trainer.params), _host(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_batches_are_refused_with_a_reason():
    trainer = Trainer(tiny_model(), BASE, MESH)
    rng = np.random.RandomState(11)
    with pytest.raises(ValueError, match="exactly tbs=8"):
        trainer.step(random_batch(rng, 1, 4))
    batch = random_batch(rng, 2, 4)
    batch[3].sample_index = 0
    with pytest.raises(ValueError, match="group is not complete"):
        trainer.step(batch)
    with pytest.raises(ValueError, match="trainer version 0"):
        trainer.step(random_batch(rng, 2, 4, version=1))


def test_moe_load_metrics_are_those_of_the_trained_positions():
    """`moe/load_*`: routings per expert over the positions the loss trains on (each sample's
    last prompt token and its response but the last, as their next-token targets are the
    response), summed over micro-batches and padded length buckets; recomputed here sample by
    sample, unpadded, from the model's own per-layer loads."""
    config = dataclasses.replace(BASE, micro_batch_size=2, length_buckets=(8, 16))
    moe = dataclasses.replace(TINY, architecture="Qwen3MoeForCausalLM", num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    model = create(moe, seed=3)
    fn, params = Functional.of(model)
    batch = random_batch(np.random.RandomState(4), 2, 4, max_response=10)
    load = 0.0
    for t in batch:
        seq = np.concatenate([t.prompt_tokens, t.response_tokens])
        trained = np.zeros(len(seq), np.float32)
        trained[len(t.prompt_tokens) - 1 : len(seq) - 1] = 1.0
        out = fn.forward(params, jnp.asarray(seq[None]), jnp.arange(len(seq))[None],
                         load_weights=jnp.asarray(trained[None]))  # fmt: skip
        load = load + np.asarray(out.expert_load, np.float64)
    mean = load.mean(axis=1, keepdims=True)
    trainer = Trainer(create(moe, seed=3), config, MESH)
    m = trainer.step(_with_behaviour(trainer, batch))
    assert m["moe/load_max_over_mean"] == pytest.approx((load / mean).max(axis=1).mean())
    assert m["moe/load_min_over_mean"] == pytest.approx((load / mean).min(axis=1).mean())
    dense = Trainer(tiny_model(), config, MESH)
    assert not any(k.startswith("moe/") for k in dense.step(_with_behaviour(dense, batch)))
