"""How far a training step and a decode loop overlap on this host, with the bench's model.

    .venv/bin/python benchmarks/train_decode_overlap.py [--steps 300] [--train-steps 3]

DORA's speed-up assumes training and generation run side by side (on TPU/GPU, on their own
chips). On a CPU host they share the cores, and each may already use more than one. This runs a
decode loop of one engine (16 busy slots, a read-back per step, as the rollout does) and
training steps of one trainer (TBS 64 of the bench's heavy-tailed lengths), first one after the
other, then on two threads at once, and prints wall and CPU seconds of each, per repeat.
Perfect overlap would take max(decode, train); none would take their sum.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dora_jax.runtime import cpu_flags_lib  # noqa: E402

cpu_flags_lib.use_cpu_devices(4)

import numpy as np  # noqa: E402

from configs import bench_longtail  # noqa: E402
from dora_jax import models  # noqa: E402
from dora_jax.engine.request_lib import Request  # noqa: E402
from dora_jax.rollout import bench_lib  # noqa: E402
from dora_jax.rollout.config_lib import RolloutConfig, train_config  # noqa: E402
from dora_jax.runtime.devices_lib import plan_devices  # noqa: E402
from dora_jax.train import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="decode steps per measurement")
    parser.add_argument("--train-steps", type=int, default=3, help="training steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = bench_longtail.get_config()
    runtime = config.runtime.to_dict()
    # Engines and trainer in this process, on shared cores: that is what this measures.
    del runtime["generation_hosts"], runtime["train_cpu_cores"]
    plan = plan_devices(**runtime)
    model_config = models.ModelConfig(**config.model.to_dict())
    engine = bench_lib._engines(config, models.create(model_config, seed=0), plan)[0]
    params = engine.load_params()
    rollout_config = RolloutConfig.from_dict({**config.rollout.to_dict(), "mode": "dora"})
    trainer = Trainer(
        models.create(model_config, seed=0),
        train_config(rollout_config, config.train, config.engine.temperature),
        plan.train_mesh,
    )
    w = config.workload
    rng = np.random.default_rng(0)
    lengths = bench_lib.response_lengths(config, 64, rng)
    slots = list(range(engine.max_concurrent_decodes))
    # A prompt per slot: a refill prefills every one (identical prompts would share one).
    requests = [
        Request(
            prompt_tokens=np.full(w.prompt_length, slot % config.model.vocab_size, np.int32),
            max_new_tokens=w.max_length,
            ignore_eos=True,
            seed=slot,
            id=(slot, 0),
        )
        for slot in slots
    ]

    def fill(state):
        prefix, _ = engine.prefill_requests(params, requests)
        return engine.insert(prefix, engine.free_slot(state, slots), slots)

    def decode(steps: int) -> None:
        state = fill(engine.init_decode_state())
        for i in range(steps):
            if i % (w.max_length - 1) == w.max_length - 2:  # refill before the requests end
                state = fill(state)
            state, result = engine.generate(params, state)
            result.convert_to_numpy()

    def train(steps: int) -> None:
        for _ in range(steps):
            trainer.step(bench_lib.training_batch(config, lengths, trainer.version))

    def timed(fn, *a) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*a)
        return time.perf_counter() - wall, time.process_time() - cpu

    decode(20)  # compiles every shape the measurement uses
    train(1)
    print(f"# {args.steps} decode steps, {args.train_steps} training steps; wall s (cpu s)")
    print("| decode alone | train alone | sum | both at once | overlap |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for _ in range(args.repeats):
        d, d_cpu = timed(decode, args.steps)
        t, t_cpu = timed(train, args.train_steps)

        def both() -> None:
            thread = threading.Thread(target=train, args=(args.train_steps,))
            thread.start()
            decode(args.steps)
            thread.join()

        b, b_cpu = timed(both)
        # 1 = the two ran fully side by side (max), 0 = one after the other (sum).
        overlap = (d + t - b) / min(d, t)
        print(
            f"| {d:.3f} ({d_cpu:.3f}) | {t:.3f} ({t_cpu:.3f}) | {d + t:.3f} | "
            f"{b:.3f} ({b_cpu:.3f}) | {overlap:.2f} |"
        )


if __name__ == "__main__":
    main()
