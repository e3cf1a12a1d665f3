"""A training step's time on heavy-tailed batches: micro-batches by row count vs by token budget.

    taskset -c 0 .venv/bin/python benchmarks/train_micro_batching.py \
        [--sizes 4,8] [--budgets 256,512,1024] [--batches 8] [--repeats 5]

The bench's model, TBS and length buckets (`configs/bench_longtail.py`); each batch's response
lengths are drawn from its workload's log-normal (median 8, p99 / median ~ 26, max 160). Every
setting first runs every batch once (compiling each shape it meets), then the settings take
turns, `repeats` rounds over the same batches, so the host's drift falls on all of them alike.
Prints one markdown row per setting: median step time over all timed steps, the padded share of
the tokens computed (`pad_fraction`) and micro-batches per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dora_jax.runtime import cpu_flags_lib  # noqa: E402

cpu_flags_lib.use_cpu_devices(1)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import bench_longtail  # noqa: E402
from dora_jax import models  # noqa: E402
from dora_jax.models import sharding_lib  # noqa: E402
from dora_jax.rollout import bench_lib  # noqa: E402
from dora_jax.rollout.config_lib import RolloutConfig, train_config  # noqa: E402
from dora_jax.train import Trainer, batch_lib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,8", help="micro_batch_size settings")
    parser.add_argument("--budgets", default="256,512,1024", help="micro_batch_tokens settings")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    config = bench_longtail.get_config()
    tbs = config.rollout.train_batch_size
    rng = np.random.default_rng(0)
    batches = [bench_lib.response_lengths(config, tbs, rng) for _ in range(args.batches)]
    settings = [("micro_batch_size", int(s)) for s in args.sizes.split(",") if s] + [
        ("micro_batch_tokens", int(b)) for b in args.budgets.split(",") if b
    ]
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    mesh = sharding_lib.make_mesh(jax.devices()[:1], 1, 1)
    model_config = models.ModelConfig(**config.model.to_dict())
    trainers = {}
    for field, value in settings:
        train = config.train.to_dict()
        train.update(micro_batch_size=None, micro_batch_tokens=None)
        train[field] = value
        trainer = Trainer(
            models.create(model_config, seed=0),
            train_config(rollout, train, config.engine.temperature),
            mesh,
        )
        for lengths in batches:  # compiles every shape this setting meets
            trainer.step(bench_lib.training_batch(config, lengths, trainer.version))
        trainers[(field, value)] = trainer
    times: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    pads: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for setting, trainer in trainers.items():
            for lengths in batches:
                start = time.perf_counter()
                m = trainer.step(bench_lib.training_batch(config, lengths, trainer.version))
                times[setting].append(time.perf_counter() - start)
                pads[setting].append(m["pad_fraction"])
    print(
        f"# TBS {tbs}, {args.batches} batches x {args.repeats} rounds, length buckets "
        f"{tuple(config.train.length_buckets)}; jax {jax.__version__} on {jax.default_backend()}"
    )
    print("| setting | step ms (median) | vs first | pad_fraction | micro-batches per step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    first = None
    for setting in settings:
        field, value = setting
        ms = 1e3 * float(np.median(times[setting]))
        first = first or ms
        cfg = trainers[setting].config
        counts = [
            len(batch_lib.micro_batches(
                bench_lib.training_batch(config, lengths, 0), np.arange(tbs),
                cfg.length_buckets, False, **cfg.micro_batching,
            ))
            for lengths in batches
        ]  # fmt: skip
        print(
            f"| {field}={value} | {ms:.1f} | {first / ms:.2f}x | "
            f"{np.mean(pads[setting]):.2f} | {np.mean(counts):.1f} |"
        )


if __name__ == "__main__":
    main()
