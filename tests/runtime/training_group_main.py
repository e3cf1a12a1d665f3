"""The script behind `training_hosts_lib_test`: a training group of this process and one
training host, 2 virtual CPU devices each, trains through `MirroredTrainer` and saves what it
published to `sys.argv[1]` (npz). The host is a child process, or with `sys.argv[2]` the
`dora-jax host` listening at that address. A process joins a group before JAX computes
anything, which the test process, with its 8 devices long in use, cannot; so this runs in a
process of its own.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))

from train_fixtures import TINY, random_batch, tiny_model  # noqa: E402

from dora_jax.runtime import cpu_flags_lib, training_hosts_lib  # noqa: E402
from dora_jax.train import TrainConfig, Trainer  # noqa: E402

CONFIG = TrainConfig(
    tbs=8, group_size=4, mini_batches=2, micro_batch_size=4, learning_rate=1e-2,
    length_buckets=(8, 16),
)  # fmt: skip
MESH_SHAPE = (2, 2)  # (fsdp, tp) over the group's 4 devices


def batches() -> list:
    return [random_batch(np.random.RandomState(seed), 2, 4, max_response=12) for seed in (0, 1)]


def train(trainer, batches) -> dict[str, np.ndarray]:
    """Two iterations, then the second again from the state after the first (restore); returns
    every published version's params and the losses, flat."""
    import jax

    out = {}
    out["loss1"] = np.float64(trainer.step(batches[0])["loss"])
    out["v1"] = _flat(trainer.publish().params)
    after_first = jax.device_get(trainer.state)  # the next step donates a Trainer's buffers
    out["loss2"] = np.float64(trainer.step(batches[1])["loss"])
    out["v2"] = _flat(trainer.publish().params)
    trainer.restore(after_first)
    out["loss2_again"] = np.float64(trainer.step(batches[1])["loss"])
    out["v2_again"] = _flat(trainer.publish().params)
    out["version"] = np.int64(trainer.version)
    return out


def lora_model():
    from dora_jax.models import LoRAConfig, create

    return create(TINY, 0, lora=LoRAConfig(rank=2))


def train_lora(trainer) -> dict[str, np.ndarray]:
    """Two LoRA iterations: every published version whole, the bytes of each (a group's first
    gathers the whole version, the second its adapters alone), and whether the two share their
    base arrays (a training group gathered the base once)."""
    from flax import nnx

    out, published = {}, []
    for i, batch in enumerate(batches(), start=1):
        trainer.step(batch)
        published.append(trainer.publish())
        out[f"lora_v{i}"] = _flat(published[-1].params)
    out["lora_publish_bytes"] = np.float64(published[-1].metrics["publish_bytes"])
    out["lora_first_publish_bytes"] = np.float64(published[0].metrics["publish_bytes"])
    first, second = (nnx.filter_state(p.params, nnx.Not(nnx.LoRAParam)) for p in published)
    out["lora_base_shared"] = np.bool_(
        all(a is b for a, b in zip(_leaves(first), _leaves(second), strict=True))
    )
    return out


def _leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


def _flat(tree) -> np.ndarray:
    import jax

    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def make_trainer(graphdef, state) -> Trainer:
    """Built on every process of the group: the factory the hosts receive by name."""
    import jax
    from flax import nnx

    from dora_jax.models import sharding_lib

    return Trainer(
        nnx.merge(graphdef, state), CONFIG, sharding_lib.make_mesh(jax.devices(), *MESH_SHAPE)
    )


def main(path: str, host: str | None) -> None:
    if host is None:
        group = training_hosts_lib.start_local(1)
    else:
        coordinator = f"127.0.0.1:{training_hosts_lib.free_port()}"
        group = training_hosts_lib.connect([host], coordinator)
    try:
        import jax
        from flax import nnx

        from dora_jax.train.trainer_lib import MirroredTrainer

        assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
        # The factory goes to the host pickled by name: by this module's name, which a host
        # imports (on its PYTHONPATH), not as __main__'s.
        import training_group_main

        graphdef, state = nnx.split(tiny_model())
        factory = training_group_main.make_trainer
        trainer = MirroredTrainer(group.make(factory, graphdef, jax.device_get(state)))
        out = train(trainer, batches())
        published = trainer.publish().params
        out["host_arrays"] = np.bool_(
            all(type(x) is np.ndarray for x in jax.tree.leaves(published))
        )
        if host is None:  # a LoRA policy: the base is gathered once, then adapters alone
            graphdef, state = nnx.split(lora_model())
            lora = MirroredTrainer(group.make(factory, graphdef, jax.device_get(state)))
            out.update(train_lora(lora))
        np.savez(path, **out)
    finally:
        group.close()


if __name__ == "__main__":
    cpu_flags_lib.use_cpu_devices(2)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
