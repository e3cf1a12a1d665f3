"""`dora-jax bench` on a tiny config: the figures are there, the audits pass (partial fails C1
only), every mode trained exactly the same samples (the "identical work" claim, checked), every
repeat of a mode wrote the same ledger, a `mode@variant` entry ran its own settings, and each
entry's schedule is the one the engine double gives (what `benchmarks/rollout_schedule.py`
prints)."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib

import jax
import ml_collections
import numpy as np
import pytest
from rollout_harness import bench_schedule
from tiny_models import DENSE

from configs import default
from dora_jax.config_fields_lib import ConfigError
from dora_jax.engine import Engine
from dora_jax.engine.request_lib import Request as EngineRequest
from dora_jax.models import create
from dora_jax.rollout import audit_lib, bench_lib, ledger_lib, telemetry_lib

BENCH_CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "bench_longtail.py"

MODES = ("sync", "dora", "partial", "dora@k1", "dora@steps3")


def tiny_config():
    spec = importlib.util.spec_from_file_location("bench_longtail", BENCH_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.modes = ",".join(MODES)
    c.warmup_iterations = 1
    c.repeats = 2
    c.model.hidden_size = 16
    c.model.intermediate_size = 32
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.model.head_dim = 8
    c.runtime.train_devices = 2
    c.runtime.num_instances = 2
    c.runtime.train_cpu_cores = 0  # one process: the trainer process has a test of its own
    c.workload.median_length = 4
    c.workload.max_length = 24
    c.engine.slots = 4
    c.rollout.train_batch_size = 8
    c.rollout.rollout_batch_size = 16
    c.rollout.num_iterations = 3
    c.rollout.timer_steps = 2
    c.rollout.publish_delay_steps = 2
    c.train.length_buckets = (32,)
    c.variants.k1 = ml_collections.ConfigDict({"staleness_bound": 1})
    c.variants.steps3 = ml_collections.ConfigDict({"decode_steps_per_turn": 3})
    return c


def start_event(workdir: str) -> dict:
    return next(e for e in ledger_lib.read(workdir) if e["event"] == "start")


def trained(workdir: str) -> collections.Counter:
    return collections.Counter(
        (e["prompt_id"], e["sample_index"], e["response_length"])
        for e in ledger_lib.read(workdir)
        if e["event"] == "train"
    )


def test_bench_reports_every_mode_on_identical_work(tmp_path, capsys):
    config = tiny_config()
    results = bench_lib.run_bench(config, str(tmp_path))
    # Minutes of compiling come before the first figure: each phase says itself as it starts.
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "] " in line]
    assert said[0].startswith(f"compiling the {config.runtime.num_instances} engines'")
    assert [s.split(":")[0] for s in said[1:-1]] == list(MODES)
    assert said[-1].startswith(f"measuring: {config.repeats} repeats")
    with open(tmp_path / "bench.json") as f:
        saved = json.load(f)
    assert set(saved) == set(MODES)
    for mode in MODES:
        for key in bench_lib.REPORTED:
            assert key in saved[mode], (mode, key)
            assert saved[mode][key] >= 0, (mode, key)
        assert saved[mode]["trained_tokens_per_s"] > 0
        assert saved[mode]["trained_tokens"] == results[mode]["trained_tokens"]
        assert len(saved[mode]["trained_tokens_per_s_repeats"]) == config.repeats
        assert saved[mode]["ledgers_identical"], mode  # same seed, same config: same ledger
        # Process CPU time over a run: positive, and no more than every core busy all along.
        assert 0 < saved[mode]["cpu_seconds"] <= saved[mode]["wall_seconds"] * os.cpu_count()
        report = audit_lib.audit(str(tmp_path / mode))
        if mode == "partial":
            assert not report.rules["C1"], report.format()  # re-prefill under new versions
            assert all(ok for rule, ok in report.rules.items() if rule != "C1"), report.format()
        else:
            assert report.passed, report.format()
    work = {mode: trained(str(tmp_path / mode)) for mode in MODES}
    groups = config.rollout.num_iterations * (
        config.rollout.train_batch_size // config.rollout.group_size
    )
    assert sum(work["sync"].values()) == groups * config.rollout.group_size
    assert {p for p, _, _ in work["sync"]} == set(range(groups))
    for mode in MODES:
        assert work[mode] == work["sync"], mode
        # Each response token after the first (sampled at prefill) took a slot in one
        # instance's decode step; an instance step has `slots` slots, a decode step
        # `num_instances` instance steps. (partial decodes fewer: the re-prefill after each
        # update samples a token too.)
        decoded = sum((length - 1) * n for (_, _, length), n in work[mode].items())
        steps, instance_steps = saved[mode]["decode_steps"], saved[mode]["instance_steps"]
        assert instance_steps * config.engine.slots >= decoded, mode
        assert steps <= instance_steps <= config.runtime.num_instances * steps, mode
        # The same steps split by the hosted version's lag: they add up, and their busy slots
        # cover every decoded token again.
        by_lag = {lag: saved[mode][f"instance_steps/{lag}"] for lag in telemetry_lib.LAG_LABELS}
        assert sum(by_lag.values()) == instance_steps, mode
        busy = sum(
            n * saved[mode][f"step_occupancy/{lag}"] * config.engine.slots
            for lag, n in by_lag.items()
        )
        if mode == "partial":
            assert busy <= decoded * (1 + 1e-9), mode
        else:
            assert np.isclose(busy, decoded), mode
    # The variant ran dora under its own bound, the plain entry under the config's.
    assert start_event(str(tmp_path / "dora@k1"))["staleness_bound"] == 1
    assert start_event(str(tmp_path / "dora"))["staleness_bound"] == config.rollout.staleness_bound
    assert config.rollout.staleness_bound > 1
    stale = [e["staleness"] for e in ledger_lib.read(str(tmp_path / "dora@k1")) if "staleness" in e]
    assert stale and max(stale) <= 1
    # Only the newest version decodes in sync, and partial reloads it everywhere at each update.
    for mode in ("sync", "partial"):
        assert saved[mode]["instance_steps/lag0"] == saved[mode]["instance_steps"], mode
    # The schedule is a function of the config and seed: the engine double, which knows nothing
    # of the model, takes the same steps at the same occupancy as the real engine and trainer.
    for mode in MODES:
        logical = bench_schedule(config, mode, str(tmp_path / "double" / mode))
        for key, value in logical.items():
            assert saved[mode][key] == value, (mode, key)


@pytest.mark.parametrize(
    "modes, variant, message",
    [
        ("sync,dora@none", {}, "'dora@none' names no entry of config.variants"),
        ("dora@big", {"train_batch_size": 16}, "variants.big.train_batch_size: a variant cannot"),
        ("dora@big", {"staleness_bound": -1}, "'dora@big': rollout.staleness_bound=-1"),
        ("dora@big", {"rollout_batchsize": 32}, r"'dora@big': rollout: unknown field"),
    ],
)
def test_a_bad_variant_fails_before_anything_runs_naming_it(modes, variant, message):
    config = tiny_config()
    config.modes = modes
    config.variants.big = ml_collections.ConfigDict(variant)
    with pytest.raises(ValueError, match=message):
        bench_lib.rollout_configs(config)


@pytest.mark.parametrize(
    "section, field, value, named",
    [
        (None, "repeats", 0, "repeats=0"),
        (None, "warmup_iterations", -1, "warmup_iterations=-1"),
        ("engine", "slots", 0, "engine.slots=0"),
        ("train", "micro_batch_size", 5, "micro_batch_size"),  # TBS 8 is not a multiple of it
    ],
)
def test_a_bad_bench_field_fails_before_anything_is_built(tmp_path, section, field, value, named):
    config = tiny_config()
    (config if section is None else config[section])[field] = value
    with pytest.raises(ValueError, match=named):
        bench_lib.run_bench(config, str(tmp_path))
    assert not os.listdir(tmp_path)  # no engine, trainer or run directory was made


def test_a_training_config_is_refused_as_no_bench_config(tmp_path):
    with pytest.raises(ConfigError, match="runs a bench config .*configs/bench_longtail.py"):
        bench_lib.run_bench(default.get_config(), str(tmp_path))
    assert not os.listdir(tmp_path)


def test_precompile_covers_every_admission_shape_for_any_slot_count_and_decode_call():
    # 3 slots: a full admission pads its rows to 4, more rows than slots.
    engine = Engine(
        create(DENSE, seed=0), max_concurrent_decodes=3, max_prefill_length=16, max_decode_length=4
    )
    bench_lib.precompile_engines([engine], [2, 1, 2], DENSE.vocab_size)
    compiled = engine._admit_jit._cache_size()
    assert engine._generate_steps_jit._cache_size() == 2
    params = engine.load_params()
    for length in (1, 9):  # one prompt per prefill bucket (8, 16)
        for n, distinct in [(r, d) for r in range(1, 4) for d in range(1, r + 1)]:
            requests = [
                EngineRequest(prompt_tokens=[i % distinct] * length, max_new_tokens=2, seed=i)
                for i in range(n)
            ]
            state, _ = engine.admit(params, engine.init_decode_state(), requests, range(n))
            jax.block_until_ready(state)
    assert engine.prefill_buckets == (8, 16)
    assert engine._admit_jit._cache_size() == compiled  # nothing new compiled mid-run


def test_precompile_covers_every_micro_batch_shape_of_a_token_budget():
    """Under `train.micro_batch_tokens` the micro-batches of a step take any power-of-two row
    count per length bucket; after `precompile_trainer`, steps on the workload's heavy-tailed
    lengths compile no micro-step of their own (they would land in the measured runs)."""
    from dora_jax import models
    from dora_jax.models import sharding_lib
    from dora_jax.rollout.config_lib import RolloutConfig, train_config
    from dora_jax.train import Trainer, trainer_lib

    config = tiny_config()
    config.train.length_buckets = (8, 16, 32)
    config.train.micro_batch_tokens = 48  # 4 rows of 8, 2 of 16, 1 of the longest (32)
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    model = models.create(models.ModelConfig(**config.model.to_dict()), seed=0)
    trainer = Trainer(
        model,
        train_config(rollout, config.train, config.engine.temperature),
        sharding_lib.make_mesh(jax.devices()[:1], 1, 1),
    )
    bench_lib.precompile_trainer(trainer, config)
    compiled = trainer_lib._accumulate._cache_size()
    w, rng = config.workload, np.random.default_rng(0)
    for _ in range(12):
        lengths = np.exp(np.log(w.median_length) + w.sigma * rng.standard_normal(8))
        lengths = np.clip(lengths, 1, w.max_length).astype(int)
        trainer.step(bench_lib.training_batch(config, lengths, trainer.version))
    assert trainer_lib._accumulate._cache_size() == compiled


@pytest.mark.slow
def test_on_generation_hosts_the_bench_writes_the_same_ledger(tmp_path):
    config = tiny_config()
    config.update(modes="dora", repeats=1, warmup_iterations=0)
    bench_lib.run_bench(config, str(tmp_path / "here"))
    config.runtime.generation_hosts = "local"
    results = bench_lib.run_bench(config, str(tmp_path / "hosts"))
    assert results["dora"]["audit_passed"]
    assert ledger_lib.read(str(tmp_path / "hosts" / "dora")) == ledger_lib.read(
        str(tmp_path / "here" / "dora")
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_a_trainer_on_cores_of_its_own_trains_the_same_samples_and_cores_come_back(tmp_path):
    """`runtime.train_cpu_cores`: same config and seed, the trainer in this process or in one of
    its own on its own core: the same ledger (the published weights cross the process boundary
    intact), and this process is back on every core it had afterwards."""
    config = tiny_config()
    config.update(modes="dora", repeats=1, warmup_iterations=0)
    allowed = os.sched_getaffinity(0)
    ledgers = {}
    for cores in (0, 1):
        config.runtime.train_cpu_cores = cores
        bench_lib.run_bench(config, str(tmp_path / str(cores)))
        ledgers[cores] = (tmp_path / str(cores) / "dora" / ledger_lib.LEDGER_FILE).read_bytes()
        assert os.sched_getaffinity(0) == allowed
    assert b'"event": "train"' in ledgers[1]
    assert ledgers[1] == ledgers[0]
