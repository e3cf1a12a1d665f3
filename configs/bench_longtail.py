"""The rollout-paradigm benchmark: `dora-jax bench --config=configs/bench_longtail.py`.

All four modes run the same seeded workload with the real model, engine and trainer on virtual
CPU devices. Response lengths are forced (EOS ignored until each request's drawn length) from a
log-normal with p99/median ~ 26 (clipped at max_length), like the DORA paper's math rollouts;
the workload is `num_iterations` batches of prompts and every mode trains all of them, so every
mode does identical work and only the scheduling differs. The settings below were chosen from
measurements on the 2-core CPU machine (BENCHMARKS.md, "Rollout paradigms (CPU)").
"""

import ml_collections

from dora_jax.rollout import config_lib as rollout_config_lib
from dora_jax.runtime import compile_cache_lib
from dora_jax.train import config_lib as train_config_lib


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_cpu_devices = 4
    c.compilation_cache_dir = compile_cache_lib.DEFAULT_DIRECTORY
    c.modes = "sync,one_step_off,partial,dora"
    # Named retunings of `rollout`, run as `mode@name` entries of `modes` in the same process as
    # the plain modes, e.g. `--config.modes=sync,dora,dora@tight`; their fields can be
    # overridden from the command line like any other (`--config.variants.tight.staleness_bound=5`).
    # `tight` keeps less in flight under a tighter bound (the bench's settings before 12-06):
    # 4660 instance steps against the bench's 4256.
    c.variants = ml_collections.ConfigDict()
    c.variants.tight = ml_collections.ConfigDict()
    c.variants.tight.rollout_batch_size = 160
    c.variants.tight.staleness_bound = 6
    # A warm-up run of this many iterations (another seed's prompts) before the measured run,
    # after explicit compilation of every prefill bucket, slot move and trainer bucket; the
    # trainer is then reset to its initial state. Nothing of it enters the figures.
    c.warmup_iterations = 2
    # Measured runs per mode, the modes taking turns; each figure is the median. On a shared
    # 2-core machine one run of a mode varies by about +-25% (measured), more than the gaps
    # between modes.
    c.repeats = 3

    c.model = ml_collections.ConfigDict()
    c.model.architecture = "LlamaForCausalLM"  # no q/k norms: the model of the figures below
    c.model.vocab_size = 64
    c.model.hidden_size = 64
    c.model.intermediate_size = 128
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16

    c.runtime = ml_collections.ConfigDict()
    # Rollout gets most of the machine, as in real RL deployments; on CPU every virtual device
    # shares the same 2 cores, and fewer, wider instances cost less per decoded token (one
    # XLA program per instance per step: ~0.8 ms for 16 slots vs ~1 ms for 8, measured). One
    # training device: a step took 0.104 s on 1 virtual device and 0.107 s on 2 (fsdp buys
    # nothing on 2 shared cores), and one device leaves the other core to decoding.
    c.runtime.train_devices = 1
    c.runtime.train_tp = 1
    c.runtime.num_instances = 3
    c.runtime.devices_per_instance = 1
    # "local": each instance's engine in a child process of its own (`runtime.hosts_lib`).
    c.runtime.generation_hosts = ""
    # The trainer's own hardware, as on a pod: every mode's trainer runs in a process of its own
    # pinned to this many cores, the controller and the engines on the rest (`cpu_cores_lib`).
    # With 0 (everything on both cores) sync's rollout borrows the trainer's idle core and the
    # other modes pay for training in contention with decoding: dora 1.6-1.9x sync there,
    # against 2.2x with 1 (BENCHMARKS.md).
    c.runtime.train_cpu_cores = 1

    c.workload = ml_collections.ConfigDict()
    c.workload.prompt_length = 8
    c.workload.median_length = 8
    c.workload.max_length = 160
    c.workload.sigma = 1.4

    c.engine = ml_collections.ConfigDict()
    c.engine.slots = 16
    c.engine.temperature = 1.0  # the engines sample at it, and the trainer trains that policy

    # RBS applies to dora and partial only; sync and one_step_off generate exactly their batch.
    # K bounds how far a version's long tail may lag (dora and partial): a group is due K
    # iterations after its version, so a max_length response (160 decode steps) plus its wait
    # for a slot must fit in K iterations of ~publish_delay_steps (40) decode steps, or the
    # trainer waits for it. dora's schedule is logical (the bench's `instance_steps`, the same
    # on any machine): 4660 instance steps at RBS 160 / K 6, 4356 at 192 / 8 (4256 since spare
    # slots take older versions' work only, BENCHMARKS.md), 4650 at 224 / 8,
    # 4795 at 192 / 7, 4212 at 192 / 10; 192 / 8 was the fastest in two sweeps (BENCHMARKS.md).
    # publish_delay_steps: about one training step (~45 ms on its own core) in decode steps
    # (~1.3 ms for three instances), so the trainer's step overlaps decoding instead of the loop
    # blocking on it; 32 and 48 were no faster. decode_steps_per_turn: every mode runs 8 decode
    # steps per engine call; against 1, sync 1.63x and dora 1.6x faster (the host's per-call
    # cost was most of a step's on this small model), 16 gave sync 4% more and dora 4% less.
    c.rollout = rollout_config_lib.config_section(
        train_batch_size=64,
        rollout_batch_size=192,
        group_size=4,
        staleness_bound=8,
        num_iterations=36,
        timer_steps=8,
        publish_delay_steps=40,
        decode_steps_per_turn=8,
    )
    del c.rollout["mode"]  # `modes` picks each run's paradigm

    # Length-sorted micro-batches of 4 with fine buckets, for every mode alike: 29% padding
    # against 47% with micro-batches of 8 and buckets (16, 32, 64, 128, 192), and a TBS-64 step
    # of the bench's lengths in ~80-90 ms against ~110-130 ms (measured in isolation).
    c.train = train_config_lib.config_section(
        learning_rate=1e-4,
        length_buckets=(16, 24, 32, 48, 64, 96, 128, 192),
        micro_batch_size=4,
    )
    return c
