"""What a training group costs per RL step: the trainer on 4 devices of one process against the
same mesh across two processes (this one and a training host, 2 devices each, `jax.distributed`
over gloo), with the bench's model and TBS-64 batches of its heavy-tailed lengths.

    .venv/bin/python benchmarks/training_hosts.py [--steps 6] [--rounds 3] [--micro-batch 4]

A process joins a group before JAX computes anything, so each measurement is a fresh process:
the two take turns for `--rounds` rounds, and the table gives each round's median step time,
the group's publish time (gathering a version to host arrays), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dora_jax.runtime import cpu_flags_lib, training_hosts_lib  # noqa: E402


def make_trainer(graphdef, state, tp: int, micro_batch: int):
    """Built on every process of the group (the host receives it by name)."""
    import jax
    from flax import nnx

    from configs import bench_longtail
    from dora_jax.models import sharding_lib
    from dora_jax.rollout.config_lib import RolloutConfig, train_config
    from dora_jax.train import Trainer

    config = bench_longtail.get_config()
    config.train.micro_batch_size = micro_batch
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    mesh = sharding_lib.make_mesh(jax.devices(), len(jax.devices()) // tp, tp)
    return Trainer(
        nnx.merge(graphdef, state),
        train_config(rollout, config.train, config.engine.temperature),
        mesh,
    )


def measure(group_size: int, steps: int, micro_batch: int) -> dict[str, float]:
    """Step and publish seconds of `steps` training steps after one that compiles."""
    group = training_hosts_lib.start_local(group_size - 1) if group_size > 1 else None
    import jax
    import numpy as np
    from flax import nnx

    from configs import bench_longtail
    from dora_jax import models
    from dora_jax.rollout import bench_lib
    from dora_jax.train.trainer_lib import MirroredTrainer

    config = bench_longtail.get_config()
    model = models.create(models.ModelConfig(**config.model.to_dict()), seed=0)
    graphdef, state = nnx.split(model)
    args = (graphdef, jax.device_get(state), 2, micro_batch)
    trainer = MirroredTrainer(group.make(make_trainer, *args)) if group else make_trainer(*args)
    rng = np.random.default_rng(0)
    lengths = bench_lib.response_lengths(config, 64, rng)
    step_s, publish_s = [], []
    for i in range(steps + 1):
        batch = bench_lib.training_batch(config, lengths, trainer.version)
        t0 = time.perf_counter()
        trainer.step(batch)
        t1 = time.perf_counter()
        jax.block_until_ready(trainer.publish().params)
        if i:  # the first compiles
            step_s.append(t1 - t0)
            publish_s.append(time.perf_counter() - t1)
    if group:
        group.close()
    return {"step_s": statistics.median(step_s), "publish_s": statistics.median(publish_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4, help="train.micro_batch_size")
    parser.add_argument("--worker", type=int, default=0, help="(internal) processes in the group")
    args = parser.parse_args()
    if args.worker:
        cpu_flags_lib.use_cpu_devices(4 // args.worker)
        print(json.dumps(measure(args.worker, args.steps, args.micro_batch)), flush=True)
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    print(
        f"# median seconds over {args.steps} TBS-64 steps in micro-batches of "
        f"{args.micro_batch}; 4 devices, fsdp 2 x tp 2"
    )
    print("| round | one process: step | publish | 2 processes: step | publish | step ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in range(args.rounds):
        out = {}
        for n in (1, 2):
            command = [sys.executable, __file__, f"--worker={n}", f"--steps={args.steps}",
                       f"--micro-batch={args.micro_batch}"]  # fmt: skip
            lines = subprocess.run(
                command, env=env, capture_output=True, text=True, check=True
            ).stdout.splitlines()
            out[n] = json.loads(lines[-1])
        print(
            f"| {r + 1} | {out[1]['step_s']:.3f} | {out[1]['publish_s']:.3f} | "
            f"{out[2]['step_s']:.3f} | {out[2]['publish_s']:.3f} | "
            f"{out[2]['step_s'] / out[1]['step_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
