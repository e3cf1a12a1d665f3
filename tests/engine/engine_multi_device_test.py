"""Slot migration between engines on two different meshes of the 8 virtual CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dora_jax.engine import Engine, Request, SamplingParams, generate_all
from dora_jax.models import ModelConfig, create, sharding_lib

DENSE = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
)
MOE = ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)
MAX_NEW = 12


def _engine(model, devices, fsdp, tp):
    return Engine(
        model,
        max_concurrent_decodes=4,
        max_prefill_length=16,
        max_decode_length=MAX_NEW,
        mesh=sharding_lib.make_mesh(devices, fsdp, tp),
        sampling=SAMPLING,
    )


def _request(prompt, seed):
    return Request(prompt_tokens=prompt, max_new_tokens=MAX_NEW, ignore_eos=True, seed=seed)


def _step(engine, params, ds, slot):
    ds, result = engine.generate(params, ds)
    r = result.convert_to_numpy().get_result_at_slot(slot)
    assert r.valid[0, 0]
    return ds, (int(r.tokens[0, 0]), float(r.log_probs[0, 0]), int(r.finish_reason[0]))


def _migrate_and_compare(config, mesh_a, mesh_b, exact):
    devices = jax.devices()
    assert len(devices) == 8
    model = create(config, seed=11)
    a = _engine(model, devices[:4], *mesh_a)
    b = _engine(model, devices[4:], *mesh_b)
    params_a, params_b = a.load_params(version=3), b.load_params(version=3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 64, n).tolist() for n in (5, 9, 3, 7)]

    # Engine A decodes three requests; the one in slot 1 will move.
    prefix, _ = a.prefill_requests(params_a, [_request(p, i) for i, p in enumerate(prompts[:3])])
    ds_a = a.insert(prefix, a.init_decode_state(), [0, 1, 2])
    for _ in range(3):
        ds_a, _ = _step(a, params_a, ds_a, 1)
    assert ds_a.cache.k[0].sharding.device_set == set(devices[:4])

    # Engine B is already busy with another request, in slot 0.
    prefix, _ = b.prefill_requests(params_b, [_request(prompts[3], 99)])
    ds_b = b.insert(prefix, b.init_decode_state(), 0)
    ds_b, _ = b.generate(params_b, ds_b)

    exported = a.export_slot(ds_a, 1)
    assert exported.cache.k[0].sharding.device_set <= set(devices[:4])
    ds_b = b.import_slot(ds_b, 2, exported)
    assert ds_b.cache.k[0].sharding.device_set == set(devices[4:])
    assert b.active_slots(ds_b).tolist() == [True, False, True, False]

    in_place, migrated = [], []
    for _ in range(MAX_NEW - 4):  # 1 token at prefill + 3 steps already
        ds_a, t = _step(a, params_a, ds_a, 1)
        in_place.append(t)
        ds_b, t = _step(b, params_b, ds_b, 2)
        migrated.append(t)
    assert [t[0] for t in migrated] == [t[0] for t in in_place]
    assert [t[2] for t in migrated] == [t[2] for t in in_place]
    assert in_place[-1][2] != 0, "the request ran to its end"
    lp_in_place = np.asarray([t[1] for t in in_place])
    lp_migrated = np.asarray([t[1] for t in migrated])
    if exact:
        np.testing.assert_array_equal(lp_migrated, lp_in_place)
    else:
        np.testing.assert_allclose(lp_migrated, lp_in_place, atol=1e-5)
    # Both slots are finished now: each engine can reuse its slot.
    assert not a.active_slots(ds_a)[1] and not b.active_slots(ds_b)[2]


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_migration_between_equal_meshes_is_exact(config):
    """Same mesh shape on disjoint devices: the continuation is bit-identical."""
    _migrate_and_compare(config, (2, 2), (2, 2), exact=True)


def test_migration_between_differently_shaped_meshes():
    """fsdp=4 -> tp=4: other reduction orders, so log-probs agree to float rounding."""
    _migrate_and_compare(DENSE, (4, 1), (1, 4), exact=False)


def test_sharded_engine_matches_single_device():
    model = create(DENSE, seed=12)
    single = Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=8)
    sharded = _engine(model, jax.devices(), 4, 2)
    assert sharded.load_params().state["layers"][0]["self_attn"]["q_proj"]["kernel"][
        ...
    ].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    rng = np.random.RandomState(1)
    requests = [
        Request(rng.randint(0, 64, n).tolist(), SAMPLING, max_new_tokens=8, seed=n)
        for n in (4, 12, 1, 6, 9)
    ]
    want = generate_all(single, single.load_params(), requests)
    got = generate_all(sharded, sharded.load_params(), requests)
    for w, g in zip(want, got, strict=True):
        assert g.tokens.tolist() == w.tokens.tolist()
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_sharded_decode_steps_match_single_device_steps():
    """`generate_steps` on an fsdp x tp mesh: the single-device engine's tokens, step by step,
    requests finishing part-way through a call included."""
    model = create(DENSE, seed=14)
    single = _engine(model, jax.devices()[:1], 1, 1)
    sharded = _engine(model, jax.devices(), 4, 2)
    rng = np.random.RandomState(2)
    requests = [
        Request(rng.randint(0, 64, n).tolist(), SAMPLING, max_new_tokens=m, seed=n)
        for n, m in ((4, 5), (12, 9), (1, 12))
    ]
    steps = {}
    for name, engine in (("single", single), ("sharded", sharded)):
        params = engine.load_params()
        ds, _ = engine.admit(params, engine.init_decode_state(), requests, [0, 2, 3])
        steps[name] = []
        for _ in range(3):
            ds, results = engine.generate_steps(params, ds, 4)
            steps[name].extend(results.convert_to_numpy())
    assert sum(r.valid.sum() for r in steps["single"]) == 4 + 8 + 11
    for want, got in zip(steps["single"], steps["sharded"], strict=True):
        assert got.data.tolist() == want.data.tolist()
        np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)


def test_import_checks_its_input():
    model = create(DENSE, seed=13)
    a = Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=12)
    short = Engine(model, max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=4)
    params = a.load_params()
    prefix, _ = a.prefill_requests(params, [_request(list(range(1, 10)), 0)])
    ds = a.insert(prefix, a.init_decode_state(), 0)
    exported = a.export_slot(ds, 0)
    with pytest.raises(ValueError, match="cache length"):
        short.import_slot(short.init_decode_state(), 0, exported)
    with pytest.raises(ValueError, match=r"slot\(s\) \[0\] still hold"):
        a.import_slot(ds, 0, exported)
    ds = a.import_slot(ds, 1, exported)  # a copy in another slot of the same engine
    assert a.active_slots(ds).tolist() == [True, True]
