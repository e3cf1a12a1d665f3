"""The rollout-paradigm benchmark: `dora-jax bench --config=configs/bench_longtail.py`.

All four modes run the same seeded workload with the real model, engine and trainer on 8
virtual CPU devices. Response lengths are forced (EOS ignored until each request's drawn
length) from a log-normal with p99/median ~ 26, like the DORA paper's math rollouts, so every
mode does identical work and only the scheduling differs.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_cpu_devices = 8
    c.modes = "sync,one_step_off,partial,dora"
    # Iterations excluded from the throughput figures: they pay XLA compilation.
    c.warmup_iterations = 2

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 64
    c.model.hidden_size = 64
    c.model.intermediate_size = 128
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16

    c.runtime = ml_collections.ConfigDict()
    c.runtime.train_devices = 4
    c.runtime.train_tp = 1
    c.runtime.num_instances = 4
    c.runtime.devices_per_instance = 1

    c.workload = ml_collections.ConfigDict()
    c.workload.prompt_length = 8
    c.workload.median_length = 8
    c.workload.max_length = 160
    c.workload.sigma = 1.4

    c.engine = ml_collections.ConfigDict()
    c.engine.slots = 8

    c.rollout = ml_collections.ConfigDict()
    c.rollout.train_batch_size = 32
    c.rollout.rollout_batch_size = 64
    c.rollout.group_size = 4
    c.rollout.staleness_bound = 2
    c.rollout.num_iterations = 10
    c.rollout.timer_steps = 8
    c.rollout.publish_delay_steps = 4

    c.train = ml_collections.ConfigDict()
    c.train.learning_rate = 1e-4
    c.train.length_buckets = (16, 32, 64, 128, 192)
    c.train.micro_batch_size = 8
    return c
