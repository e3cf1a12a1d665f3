"""What LoRA saves the trainer: device memory it holds and time per step, full fine-tuning vs
adapters of a few ranks, side by side on the same batches.

    taskset -c 0 .venv/bin/python benchmarks/train_lora.py \
        [--ranks 8,32] [--hidden 256] [--layers 4] [--batches 4] [--repeats 3]

The bench's workload (`configs/bench_longtail.py`: TBS, length buckets, log-normal response
lengths) on a wider model than its own, where adapters are a small share of the weights. With
a KL penalty and TIS on (`kl_coef`, `tis_cap`, `max_staleness` 2), the trainer holds, besides
the params: the optimizer's two moments per trained number, a reference policy and two past
versions; LoRA's share the base. "held MB" sums every array the trainer holds; every setting
compiles on all batches first, then they take turns, `repeats` rounds over the same batches.
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
from dora_jax.runtime import transfer_lib  # noqa: E402
from dora_jax.train import Trainer  # noqa: E402


def _held_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct arrays the trainer's state holds (a shared base counts once)."""
    leaves = {id(x): x for x in jax.tree.leaves(trainer.state) if isinstance(x, jax.Array)}
    return sum(x.nbytes for x in leaves.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="8,32", help="LoRA ranks to compare with full")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = bench_longtail.get_config()
    w, tbs = config.workload, config.rollout.train_batch_size
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.batches):
        lengths = np.exp(np.log(w.median_length) + w.sigma * rng.standard_normal(tbs))
        batches.append(np.clip(lengths, 1, w.max_length).astype(int))
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    train = config.train.to_dict()
    train.update(kl_coef=0.01, tis_cap=2.0, max_staleness=2)
    train = train_config(rollout, train)
    mesh = sharding_lib.make_mesh(jax.devices()[:1], 1, 1)
    heads = max(args.hidden // 64, 1)
    model_config = models.ModelConfig(
        **{
            **config.model.to_dict(),
            "hidden_size": args.hidden,
            "intermediate_size": 3 * args.hidden,
            "num_layers": args.layers,
            "num_heads": heads,
            "num_kv_heads": heads,
            "head_dim": 64,
        }
    )
    settings = [("full", None)] + [
        (f"lora r={r}", models.LoRAConfig(rank=int(r))) for r in args.ranks.split(",") if r
    ]
    trainers = {}
    for name, lora in settings:
        model = models.create(model_config, seed=0, lora=lora)
        trainer = Trainer(model, train, mesh, reference_model=model)
        for lengths in batches:  # compiles every shape this setting meets; fills TIS history
            trainer.step(bench_lib.training_batch(config, lengths, trainer.version))
            trainer.publish()
        trainers[name] = trainer
    times: dict[str, list[float]] = {name: [] for name, _ in settings}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            for lengths in batches:
                start = time.perf_counter()
                trainer.step(bench_lib.training_batch(config, lengths, trainer.version))
                times[name].append(time.perf_counter() - start)
    params = transfer_lib.tree_nbytes(trainers["full"].params)
    print(
        f"# TBS {tbs}, {args.batches} batches x {args.repeats} rounds; model hidden "
        f"{args.hidden} x {args.layers} layers, {params / 1e6:.1f} MB of float32 params; "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )
    print("| setting | trained MB | held MB | vs full | step ms (median) | vs full |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    full_held = full_ms = None
    for name, lora in settings:
        trainer = trainers[name]
        trained = (
            params
            if lora is None
            else transfer_lib.tree_nbytes(
                models.Functional.of(models.create(model_config, lora=lora))[1]
            )
            - params
        )
        held = _held_bytes(trainer)
        ms = 1e3 * float(np.median(times[name]))
        full_held, full_ms = full_held or held, full_ms or ms
        print(
            f"| {name} | {trained / 1e6:.2f} | {held / 1e6:.1f} | {held / full_held:.2f}x | "
            f"{ms:.1f} | {ms / full_ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
