"""What LoRA saves the trainer and costs the engines: device memory the trainer holds, time
per training step, and time per decode step, full fine-tuning vs adapters of a few ranks, side
by side in one run.

    taskset -c 0 .venv/bin/python benchmarks/lora.py \
        [--ranks 8,32] [--hidden 256] [--layers 4] [--batches 4] [--repeats 3]

The bench's workload (`configs/bench_longtail.py`: TBS, length buckets, log-normal response
lengths) on a wider model than its own, where adapters are a small share of the weights. With
a KL penalty and TIS on (`kl_coef`, `tis_cap`, `max_staleness` 2), the trainer holds, besides
the params: the optimizer's two moments per trained number, a reference policy and two past
versions; LoRA's share the base. "held MB" sums every array the trainer holds; every setting
compiles on all batches first, then they take turns, `repeats` rounds over the same batches.
Engines sample from base + adapters unmerged (the function the trainer differentiates, C1):
"decode ms" is one step of the bench's slots, all busy, 8 steps per engine call. Last, weight
moves onto a generation host in a process of its own (`runtime.generation_hosts`): a version
from this process, `--moves` times after the host's first, whole for full fine-tuning and as
its adapters alone for LoRA (the host keeps the base).
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
from flax import nnx  # noqa: E402

from configs import bench_longtail  # noqa: E402
from dora_jax import models  # noqa: E402
from dora_jax.engine import Engine, Request, SamplingParams  # noqa: E402
from dora_jax.models import sharding_lib  # noqa: E402
from dora_jax.rollout import bench_lib  # noqa: E402
from dora_jax.rollout.config_lib import RolloutConfig, train_config  # noqa: E402
from dora_jax.rollout.instance_lib import RolloutInstance  # noqa: E402
from dora_jax.runtime import hosts_lib, transfer_lib  # noqa: E402
from dora_jax.train import Trainer  # noqa: E402


def _held_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct arrays the trainer's state holds (a shared base counts once)."""
    leaves = {id(x): x for x in jax.tree.leaves(trainer.state) if isinstance(x, jax.Array)}
    return sum(x.nbytes for x in leaves.values())


def _decode_ms(model: models.Transformer, slots: int, prompt: int, steps: int) -> float:
    """ms per decode step with every slot busy, 8 steps per engine call."""
    engine = Engine(
        model,
        max_concurrent_decodes=slots,
        max_prefill_length=prompt,
        max_decode_length=steps + 16,
        sampling=SamplingParams(temperature=1.0),
    )
    params = engine.load_params()
    requests = [
        Request(prompt_tokens=[1] * prompt, max_new_tokens=steps + 16, ignore_eos=True, seed=i)
        for i in range(slots)
    ]
    state, _ = engine.admit(params, engine.init_decode_state(), requests, list(range(slots)))
    state, results = engine.generate_steps(params, state, 8)  # compiles
    results.convert_to_numpy()
    start = time.perf_counter()
    for _ in range(steps // 8):
        state, results = engine.generate_steps(params, state, 8)
        results.convert_to_numpy()
    return (time.perf_counter() - start) / (steps // 8 * 8) * 1e3


def _host_moves(
    model_config: models.ModelConfig, lora: models.LoRAConfig | None, moves: int
) -> tuple[list[float], int]:
    """Seconds of each of `moves` version loads onto a generation host after its first, and
    the bytes of the last."""
    engine_kwargs = {"max_concurrent_decodes": 4, "max_prefill_length": 16, "max_decode_length": 8}
    model_kwargs = {} if lora is None else {"lora": lora}
    spec = hosts_lib.EngineSpec(model_config, 0, engine_kwargs, model_kwargs=model_kwargs)
    (host,) = hosts_lib.start_local_hosts([spec])
    try:
        x = RolloutInstance(0, host)
        version = nnx.state(models.create(model_config, seed=0, lora=lora))
        x.load(0, version)
        loads = [x.load(v, version) for v in range(1, moves + 1)]
    finally:
        host.close()
    return [seconds for seconds, _ in loads], loads[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="8,32", help="LoRA ranks to compare with full")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moves", type=int, default=10, help="weight moves onto a host")
    args = parser.parse_args()

    config = bench_longtail.get_config()
    w, tbs = config.workload, config.rollout.train_batch_size
    rng = np.random.default_rng(0)
    batches = [bench_lib.response_lengths(config, tbs, rng) for _ in range(args.batches)]
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    train = config.train.to_dict()
    train.update(kl_coef=0.01, tis_cap=2.0, max_staleness=2)
    train = train_config(rollout, train, config.engine.temperature)
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
    decode = {name: [] for name, _ in settings}
    for _ in range(args.repeats):
        for name, lora in settings:
            model = models.create(model_config, seed=0, lora=lora)
            decode[name].append(_decode_ms(model, config.engine.slots, w.prompt_length, 64))
    params = transfer_lib.tree_nbytes(trainers["full"].params)
    print(
        f"# TBS {tbs}, {args.batches} batches x {args.repeats} rounds; model hidden "
        f"{args.hidden} x {args.layers} layers, {params / 1e6:.1f} MB of float32 params; "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )
    print(
        "| setting | trained MB | held MB | vs full | step ms (median) | vs full "
        "| decode ms (median) | vs full |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    full_held = full_ms = full_decode = None
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
        step = float(np.median(decode[name]))
        full_held, full_ms, full_decode = full_held or held, full_ms or ms, full_decode or step
        print(
            f"| {name} | {trained / 1e6:.2f} | {held / 1e6:.1f} | {held / full_held:.2f}x | "
            f"{ms:.1f} | {ms / full_ms:.2f}x | {step:.2f} | {step / full_decode:.2f}x |"
        )

    print()
    print("| setting | bytes per move onto a generation host | ms (median) | vs full |")
    print("| --- | ---: | ---: | ---: |")
    full_move = None
    for name, lora in settings:
        seconds, nbytes = _host_moves(model_config, lora, args.moves)
        ms = 1e3 * float(np.median(seconds))
        full_move = full_move or ms
        print(f"| {name} | {nbytes:,} | {ms:.1f} | {ms / full_move:.2f}x |")


if __name__ == "__main__":
    main()
