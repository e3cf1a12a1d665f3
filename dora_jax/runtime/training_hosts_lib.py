"""Training hosts: the training mesh across processes (`jax.distributed`, gloo on CPU).

DESIGN.md's many-controllers shape, for the trainer. A multi-controller JAX program needs
every process to launch the same computations in the same order, while dora_jax's decisions
(the orchestrator, the ledger, the checkpoints) belong to one controller. So the controller is
process 0 of the group and every other process is a training host that follows it: each object
that computes on the training mesh (the RL trainer, the supervised warm-up) is built and called
through a `Group`, which sends the call to every host before making it itself. The hosts need no
config or files of their own; what they build arrives over the connection, like a generation
host's `EngineSpec`.

Whatever such a call returns leaves the mesh as host arrays, gathered from every process
(`process_allgather`, itself a collective the hosts take part in): the rest of the controller,
the generation hosts and the checkpoints then see plain numpy, never an array that spans
processes. A host that fails ends the run: the controller watches each host's connection and
exits as soon as one closes (a computation waiting on that host would otherwise wait for JAX's
heartbeat timeout, 100 s). The newest checkpoint resumes the run, as after any trainer crash.

`start_local` starts hosts as child processes of this machine (CPU); `dora-jax host` runs one on
another machine, which `connect` reaches over TCP with the shared key of `hosts_lib`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import socket
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from dora_jax.runtime import hosts_lib


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """A process's place in the group: the coordinator (process 0's HOST:PORT, which the
    coordination service listens on), the group's size and this process's index."""

    coordinator: str
    num_processes: int
    process_id: int


def initialize(spec: TrainingSpec) -> None:
    """Joins the group; before anything else touches JAX in this process.

    Bringing the backend up is itself collective (processes exchange their device lists), so
    every process asks for its devices here rather than at its first computation.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id)
    jax.devices()


def to_host(tree: Any) -> Any:
    """`tree` with every JAX array as a numpy array holding its global value. Collective: every
    process of the group calls it on a tree of the same structure."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.device_get(tree)
    # Only the arrays: process_allgather would also stack a Python number from every process.
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    gathered = multihost_utils.process_allgather([leaves[i] for i in where], tiled=True)
    for i, x in zip(where, gathered, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def follow(connection: Any, spec: TrainingSpec) -> None:
    """A training host: joins the group as `spec` says, then builds and calls what the
    controller at the other end of `connection` builds and calls, in its order, until the
    controller closes the group (or its end of the connection)."""
    initialize(spec)
    objects: dict[int, Any] = {}
    while True:
        try:
            command, key, target, args = connection.recv()
            if command == "close":
                return
            if command == "make":
                objects[key] = target(*args)
            elif command == "call":
                to_host(getattr(objects[key], target)(*args))
            elif command == "get":
                to_host(getattr(objects[key], target))
            else:  # "drop"
                objects.pop(key, None)
        except EOFError:
            return
        except Exception:  # noqa: BLE001 - the group cannot go on without this process
            # (a factory this host cannot import included: it arrives pickled by name)
            print(f"training host {spec.process_id}:\n{traceback.format_exc()}", flush=True)
            os._exit(1)


class Mirrored:
    """An object built on every process of a group; its calls run everywhere, results on host."""

    def __init__(self, group: Group, key: int, local: Any):
        self._group = group
        self._key = key
        self.local = local  # the controller's own instance, for reads that compute nothing

    def call(self, method: str, *args: Any) -> Any:
        """`method(*args)` on every process; the controller's result, as host arrays."""
        with self._group.lock:
            self._group.send("call", self._key, method, args)
            return to_host(getattr(self.local, method)(*args))

    def get(self, name: str) -> Any:
        """Attribute `name` (e.g. params), gathered to host arrays on every process."""
        with self._group.lock:
            self._group.send("get", self._key, name, ())
            return to_host(getattr(self.local, name))

    def close(self) -> None:
        with self._group.lock:
            self._group.send("drop", self._key, None, ())


class Group:
    """The controller's end of a training group: process 0, with a connection per host."""

    def __init__(self, connections: Sequence[Any], processes: Sequence[Any] = ()):
        self.connections = list(connections)
        self.processes = list(processes)
        self.lock = threading.RLock()  # a call goes out and runs here as one step
        self._keys = itertools.count()
        self._closing = False
        for i, connection in enumerate(self.connections, start=1):
            threading.Thread(
                target=self._watch, args=(i, connection), daemon=True, name=f"watch{i}"
            ).start()

    def _watch(self, process_id: int, connection: Any) -> None:
        """Hosts send nothing: a receive returns only when the host's end closes."""
        with contextlib.suppress(EOFError, OSError):
            connection.recv()
        if not self._closing:
            print(
                f"training host {process_id} ended, and the training mesh cannot go on "
                "without it: stopping the run (it resumes from the newest checkpoint)",
                flush=True,
            )
            os._exit(1)

    def send(self, command: str, key: int, target: Any, args: tuple[Any, ...]) -> None:
        for connection in self.connections:
            connection.send((command, key, target, args))

    def make(self, factory: Callable[..., Any], *args: Any) -> Mirrored:
        """`factory(*args)` on every process (`factory` a module-level function, `args` plain
        data: they are pickled to the hosts)."""
        with self.lock:
            key = next(self._keys)
            self.send("make", key, factory, args)
            return Mirrored(self, key, factory(*args))

    def close(self) -> None:
        """Ends the group: the hosts return, and every process leaves `jax.distributed`
        through one barrier. Here rather than at exit: a child host takes SIGTERM as JAX's
        preemption notice, so `multiprocessing`'s exit handler, which terminates and joins its
        children before JAX's own exit handler runs, would wait on it until the barrier timed
        out."""
        import jax

        self._closing = True
        # A message, not closing the connection: a watch thread is blocked reading it, and the
        # host would not see a close until that read returned.
        self.send("close", -1, None, ())
        jax.distributed.shutdown()
        for process in self.processes:
            process.join(timeout=60)
        for connection in self.connections:
            connection.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(num_hosts: int) -> Group:
    """Starts `num_hosts` training hosts as child processes (fresh interpreters: a forked JAX
    runtime is not safe) and joins them as process 0, on a loopback coordinator."""
    coordinator = f"127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    connections, processes = [], []
    for i in range(1, num_hosts + 1):
        ours, theirs = context.Pipe()
        spec = TrainingSpec(coordinator, num_hosts + 1, i)
        process = context.Process(
            target=follow, args=(theirs, spec), daemon=True, name=f"trainer{i}"
        )
        process.start()
        theirs.close()
        connections.append(ours)
        processes.append(process)
    initialize(TrainingSpec(coordinator, num_hosts + 1, 0))
    return Group(connections, processes)


def connect(addresses: Sequence[str], coordinator: str) -> Group:
    """Joins running `dora-jax host`s as training hosts 1..N, with this process as process 0
    and its coordination service at `coordinator` (HOST:PORT the hosts can reach)."""
    from multiprocessing.connection import Client

    hosts_lib.parse_address(coordinator, "runtime.coordinator")
    key = hosts_lib.host_key()
    connections = []
    for i, address in enumerate(addresses, start=1):
        connection = Client(hosts_lib.parse_address(address), authkey=key)
        connection.send(TrainingSpec(coordinator, len(addresses) + 1, i))
        connections.append(connection)
    initialize(TrainingSpec(coordinator, len(addresses) + 1, 0))
    return Group(connections)
