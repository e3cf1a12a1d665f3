"""The trainer in its own OS process, on CPU cores of its own (`runtime.train_cpu_cores`).

Why: in one process the trainer's Python (batching, ~20 dispatches a step, metrics) and the
rollout controller's share one interpreter lock, and each hand-over of the lock delays the
controller's next decode dispatch; with every mesh on every core, training also competes with
decoding for the cores. In its own process, pinned to its own cores (`cpu_cores_lib`), the
trainer is what DESIGN.md assumes it is: hardware of its own beside the generation instances.
Batches go over a pipe and each published version comes back as host arrays that the
controller places on the target instance's mesh. Everything else is the same `Trainer`:
`TrainerProcess` has its interface (`version`, `params`, `step`, `publish`, `state`,
`restore`), so the rollout loop, its ledger and its schedule do not change.

The child sees only CPU devices (`runtime.train_devices` of them): on TPU and GPU one process
owns the chips, and a trainer of its own there means hosts of its own (`training_hosts_lib`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from dora_jax.models.config_lib import ModelConfig
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.train.config_lib import TrainConfig


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """Everything the child needs to build the same `Trainer` the parent would have built."""

    model: ModelConfig
    train: TrainConfig
    seed: int
    fsdp: int = 1
    tp: int = 1
    cores: frozenset[int] | None = None  # CPU cores the process is pinned to; None = any


class TrainerProcess:
    """A `Trainer` running in a child process; same interface, host arrays across the pipe.

    `publish(target_shardings)` returns the new version placed on `target_shardings` (host
    arrays when None). An error in the child is raised here with its type and the child's
    traceback; a child that dies raises `RuntimeError` on the next call. `close()` (or the
    `with` block) stops it.
    """

    def __init__(self, spec: TrainerSpec):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, spec), name="dora_jax-trainer", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._lock = threading.Lock()
        self._version = self._receive()

    @property
    def version(self) -> int:
        return self._version

    @property
    def params(self) -> Any:
        """Host copy of the current params."""
        return self._call("params")

    @property
    def state(self) -> dict[str, Any]:
        """Host copy of everything a checkpoint needs (see `Trainer.state`)."""
        return self._call("state")

    def restore(self, state: dict[str, Any]) -> None:
        self._version = self._call("restore", state)

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        return self._call("step", list(trajectories))

    def publish(
        self, target_shardings: Any | None = None, dtype: Any = None, base: Any | None = None
    ) -> Any:
        # Imported here: the child imports this module before it may start JAX.
        from dora_jax.train.trainer_lib import publish_from_host

        # Cast in the child, before the pipe: half the bytes for a bfloat16 engine's copy.
        published = publish_from_host(
            lambda: self._call("publish", dtype), target_shardings, dtype, base
        )
        self._version = published.version
        return published

    def close(self) -> None:
        if self._process.is_alive():
            try:
                with self._lock:
                    self._conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        self._conn.close()

    def __enter__(self) -> TrainerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, command: str, argument: Any = None) -> Any:
        with self._lock:
            try:
                self._conn.send((command, argument))
            except (BrokenPipeError, OSError) as e:
                raise self._died() from e
            return self._receive()

    def _receive(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died() from e
        if ok:
            return value
        error, child_traceback = value
        raise error from RuntimeError(f"in the trainer process:\n{child_traceback}")

    def _died(self) -> RuntimeError:
        self._process.join(timeout=5)
        return RuntimeError(f"the trainer process exited (exit code {self._process.exitcode})")


def _serve(conn: Any, spec: TrainerSpec) -> None:
    """The child: builds the trainer, then answers (command, argument) pairs until `stop`."""
    from dora_jax.runtime import cpu_cores_lib, cpu_flags_lib

    if spec.cores is not None:  # before JAX starts, so that every thread it makes inherits it
        cpu_cores_lib.pin_process(spec.cores)

    # The parent's XLA_FLAGS came along; this process wants its own device count.
    inherited = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(
        f for f in inherited if not f.startswith("--xla_force_host_platform_device_count")
    )
    cpu_flags_lib.use_cpu_devices(spec.fsdp * spec.tp)
    try:
        import jax
        import numpy as np

        jax.config.update("jax_platforms", "cpu")

        from dora_jax import models
        from dora_jax.models import sharding_lib
        from dora_jax.train.trainer_lib import Trainer

        def host(tree: Any) -> Any:
            return jax.tree.map(np.asarray, jax.device_get(tree))

        mesh = sharding_lib.make_mesh(jax.devices()[: spec.fsdp * spec.tp], spec.fsdp, spec.tp)
        trainer = Trainer(models.create(spec.model, seed=spec.seed), spec.train, mesh)

        def publish(dtype: Any) -> tuple[Any, int, dict[str, float]]:
            published = trainer.publish(dtype=dtype)
            return host(published.params), published.version, published.metrics

        def restore(state: dict[str, Any]) -> int:
            trainer.restore(state)
            return trainer.version

        handlers = {
            "params": lambda _: host(trainer.params),
            "state": lambda _: host(trainer.state),
            "restore": restore,
            "step": trainer.step,
            "publish": publish,
        }
        conn.send((True, trainer.version))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        _report(conn, e)
        return
    while True:
        try:
            command, argument = conn.recv()
        except EOFError:  # the parent went away
            return
        if command == "stop":
            return
        try:
            conn.send((True, handlers[command](argument)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            _report(conn, e)


def _report(conn: Any, error: Exception) -> None:
    """Sends an error to the parent: the exception itself if it survives pickling both ways,
    else its text (an exception whose `__init__` takes other arguments than its `args` pickles
    but fails to unpickle, which the parent would see as a TypeError in its own `recv`)."""
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any pickling failure: send what can be sent
        error = RuntimeError(f"{type(error).__name__}: {error}")
    conn.send((False, (error, text)))
