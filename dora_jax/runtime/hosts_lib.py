"""Generation hosts: a rollout instance's engine in a process of its own.

DESIGN.md's second runtime shape: processes take roles and exchange weights and trajectories
through host-side queues. Here the controller (orchestrator + trainer) keeps every decision and
each generation host runs one `Engine` on its own devices; `RemoteEngine` is that engine as the
controller sees it, with the engine's interface, so the rollout instance, the orchestrator and
every paradigm run unchanged whether an engine is local or not. Commands go out in order over
one connection and are answered in order: `admit` and `generate_steps` return at once, like JAX's
asynchronous dispatch, and their tokens are read when the instance collects, so every host
decodes while the controller moves on. The decode state, the params and exported slots stay on
the host; the controller holds handles. Weights arrive as host arrays through
`runtime.transfer_lib` (the trainer's copy, or fetched from the host that holds a version), and
a migrated slot travels host to controller to host, so it still resumes without re-prefill.

`start_local_hosts` starts hosts as child processes of this machine; `dora-jax host
--address=HOST:PORT` runs one on another machine (`listen`), which `connect_hosts` reaches over
TCP. The controller sends each host its `EngineSpec` first, so a host needs no config of its own.
The connection carries pickles, so a network host only talks to a controller that knows the
shared key in `DORA_JAX_HOST_KEY` (HMAC challenge on connect), and should listen on a private
network only.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import multiprocessing.reduction
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from dora_jax.config_fields_lib import check_timeout


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything a host needs to build its engine: the model's shape and initialisation, the
    engine's settings (`Engine` keyword arguments) and how many of its devices it uses."""

    model_config: Any  # models.ModelConfig
    seed: int
    engine_kwargs: dict[str, Any]
    devices: int = 1
    tp: int = 1
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. dtypes


# How long the controller waits for any one answer, or to hand over one command. Generous: a
# host's first admission and decode step compile (minutes for a large model on an accelerator);
# past it the host counts as hung and its instance fails, rather than the whole run waiting
# forever on one machine.
# `runtime.host_timeout_s` sets it for a run.
ANSWER_TIMEOUT_S = 1800.0
# Commands up to this size go out from the controller's thread: they fit the connection's
# buffer, so writing them cannot wait on the host. Larger ones (a version's weights, a
# migrated slot) block until the host reads them, so they are written by a thread that the
# controller waits for with the timeout.
_INLINE_SEND_BYTES = 64 * 1024


class HostError(RuntimeError):
    """An engine call failed on its host; the message carries the host's traceback."""


# -- the host side -----------------------------------------------------------------------------


KEY_VARIABLE = "DORA_JAX_HOST_KEY"


def serve(connection: Any, spec: EngineSpec) -> None:
    """Runs one engine, built from `spec`, for the controller at the other end of `connection`
    until the connection closes.

    Every command is answered, an error by its traceback, and a failed command leaves the
    host serving: the controller decides what a failure means (the rollout takes the instance
    out and requeues its requests).
    """
    import jax

    from dora_jax import models
    from dora_jax.engine import Engine
    from dora_jax.models import sharding_lib

    try:
        devices = jax.devices()[: spec.devices]
        mesh = sharding_lib.make_mesh(devices, spec.devices // spec.tp, spec.tp)
        model = models.create(spec.model_config, seed=spec.seed, **spec.model_kwargs)
        engine = Engine(model, mesh=mesh, **spec.engine_kwargs)
    except Exception:  # noqa: BLE001 - the controller is waiting for the engine's settings
        connection.send(HostError(traceback.format_exc()))
        return
    # handle key -> params state, decode state or exported slot on this host; plus the params'
    # PolicyParams wrappers under ("policy", params key, version)
    held: dict[Any, Any] = {}
    connection.send(
        {
            name: getattr(engine, name)
            for name in (
                "max_concurrent_decodes",
                "max_prefill_length",
                "max_decode_length",
                "cache_length",
                "prefill_buckets",
                "param_dtype",
            )
        }
    )
    while True:
        try:
            command, args = connection.recv()
        except (EOFError, OSError):  # closed; over TCP, reset when an answer went unread
            return
        if command == "drop":  # the controller let go of a handle; nothing to answer
            held.pop(args[0], None)
            for key in [k for k in held if isinstance(k, tuple) and k[1] == args[0]]:
                del held[key]  # its PolicyParams wrappers
            continue
        try:
            reply = _HANDLERS[command](engine, held, *args)
        except Exception:  # noqa: BLE001 - every failure goes back to the controller
            reply = HostError(traceback.format_exc())
        try:
            connection.send(reply)
        except OSError:  # the controller is gone: serve the next one
            return


def _policy(engine, held, params, version):
    """The engine's `PolicyParams` of held params as `version` (the controller names the
    version with every call, so the tokens' version tags are the controller's), kept once made:
    wrapping flattens the params."""
    from dora_jax.engine.slots_lib import PolicyParams

    key = ("policy", params, version)
    if key not in held:
        held[key] = PolicyParams(held[params], version)
    return held[key]


def _load(engine, held, handle, host_tree):
    from dora_jax.runtime import transfer_lib

    held[handle] = transfer_lib.put(
        host_tree, engine.param_shardings, dtype=engine.param_dtype
    ).tree
    return None


def _keep_base(engine, held, base, params):
    """Keeps the frozen base of a LoRA policy's held params under `base`, so that later
    versions come as adapters (`_load_onto`); returns its bytes, or None where the params hold
    no adapters."""
    from dora_jax.models import lora_lib
    from dora_jax.runtime import transfer_lib

    frozen = lora_lib.frozen_base(held[params])
    if frozen is None:
        return None
    held[base] = frozen
    return transfer_lib.tree_nbytes(frozen)


def _load_onto(engine, held, handle, base, host_adapters):
    from dora_jax.runtime import transfer_lib

    held[handle] = transfer_lib.put_onto_base(
        host_adapters, engine.param_shardings, held[base], dtype=engine.param_dtype
    ).tree
    return None


def _load_model(engine, held, handle):
    held[handle] = engine.load_params().state
    return None


def _fetch(engine, held, handle, adapters_only):
    import jax
    from flax import nnx

    tree = held[handle]
    return jax.device_get(nnx.filter_state(tree, nnx.LoRAParam) if adapters_only else tree)


def _init(engine, held, handle):
    held[handle] = engine.init_decode_state()
    return None


def _admit(engine, held, params, version, state, new_state, requests, slots):
    policy = _policy(engine, held, params, version)
    held[new_state], result = engine.admit(policy, held.pop(state), requests, slots)
    return result.convert_to_numpy()


def _generate_steps(engine, held, params, version, state, new_state, steps):
    policy = _policy(engine, held, params, version)
    held[new_state], result = engine.generate_steps(policy, held.pop(state), steps)
    return result.convert_to_numpy()


def _free(engine, held, state, new_state, slot):
    held[new_state] = engine.free_slot(held.pop(state), slot)
    return None


def _export(engine, held, state, handle, slot):
    from dora_jax.runtime import transfer_lib

    held[handle] = engine.export_slot(held[state], slot)
    return transfer_lib.tree_nbytes(held[handle])


def _import(engine, held, state, new_state, slot, exported, exported_key):
    exported = held[exported_key] if exported_key is not None else exported
    held[new_state] = engine.import_slot(held.pop(state), slot, exported)
    return None


_HANDLERS = {
    "load": _load,
    "keep_base": _keep_base,
    "load_onto": _load_onto,
    "load_model": _load_model,
    "fetch": _fetch,
    "init": _init,
    "admit": _admit,
    "generate_steps": _generate_steps,
    "free": _free,
    "export": _export,
    "import": _import,
}


# -- the controller side -----------------------------------------------------------------------


class HostHandle:
    """Something that lives on a host: params, a decode state or an exported slot. It is a
    pytree leaf, so `PolicyParams` and `tree_nbytes` take it as it is. An owned handle frees its
    value on the host once the controller drops it; a decode state is consumed by the call that
    replaces it instead."""

    def __init__(self, engine: RemoteEngine, key: int, nbytes: int = 0, owned: bool = True):
        self.engine = engine
        self.key = key
        self.nbytes = nbytes
        self.owned = owned

    def fetch(self, adapters_only: bool = False) -> Any:
        """The value as host arrays; of params, their LoRA adapters alone if asked."""
        return self.engine.call("fetch", self.key, adapters_only)

    def __del__(self) -> None:
        if self.owned:
            self.engine.release(self.key)


class RemoteTarget:
    """Where `transfer_lib.put` places a version for a remote engine: on its host."""

    def __init__(self, engine: RemoteEngine):
        self.engine = engine


class PendingResult:
    """An `admit` or `generate_steps` result not read yet; `convert_to_numpy` waits for it."""

    def __init__(self, engine: RemoteEngine, ticket: int):
        self.engine = engine
        self.ticket = ticket

    def copy_to_host_async(self) -> None:
        """Already on its way: the host answers every command."""

    def convert_to_numpy(self) -> Any:
        return self.engine.wait(self.ticket)


class RemoteEngine:
    """The engine of a generation host, with the `Engine` interface the rollout uses."""

    def __init__(
        self,
        connection: Any,
        process: Any = None,
        name: str = "host",
        timeout_s: float = ANSWER_TIMEOUT_S,
    ):
        self.connection = connection
        self.process = process
        self.name = name
        self.timeout_s = check_timeout(timeout_s)
        self._keys = itertools.count()
        self._sent = 0  # commands sent that the host answers; answer i is command i's
        self._read = 0  # answers read
        self._early: dict[int, Any] = {}  # answers read while waiting for a later one
        # Commands sent without waiting (`post`): their answers are read in turn and dropped,
        # an error among them raised at the next wait.
        self._posted: set[int] = set()
        self._released: list[int] = []
        settings = self._receive()
        if isinstance(settings, HostError):
            raise settings
        self.max_concurrent_decodes = settings["max_concurrent_decodes"]
        self.max_prefill_length = settings["max_prefill_length"]
        self.max_decode_length = settings["max_decode_length"]
        self.cache_length = settings["cache_length"]
        self.prefill_buckets = settings["prefill_buckets"]
        self.param_dtype = settings["param_dtype"]
        self.param_shardings = RemoteTarget(self)

    # -- transport --

    def send(self, command: str, *args: Any) -> int:
        """Sends a command; returns the ticket its answer will carry."""
        while self._released:  # handles the controller dropped: free them on the host
            self._write(("drop", (self._released.pop(),)))
        self._write((command, args))
        self._sent += 1
        return self._sent - 1

    def _write(self, message: Any) -> None:
        """One message on the connection (as `Connection.send` frames it), within `timeout_s`:
        a host that stopped reading is a `HostError` and is cut off, not a controller blocked
        for good in a write."""
        data = multiprocessing.reduction.ForkingPickler.dumps(message)
        failure: list[BaseException] = []

        def write() -> None:
            try:
                self.connection.send_bytes(data)
            except Exception as e:  # noqa: BLE001 - also a write cut off by closing below
                failure.append(e)

        if len(data) <= _INLINE_SEND_BYTES:
            write()
        else:
            writer = threading.Thread(target=write, name=f"{self.name}-send", daemon=True)
            writer.start()
            writer.join(self.timeout_s)
            if writer.is_alive():
                # Half a message is on the wire: the connection is unusable either way.
                if self.process is not None:
                    self.process.kill()
                self.connection.close()
                raise HostError(
                    f"{self.name}: could not hand over a command in {self.timeout_s:g} s"
                )
        if failure:
            raise HostError(f"{self.name}: the connection ended ({failure[0]!r})") from failure[0]

    def wait(self, ticket: int) -> Any:
        """The answer to `ticket`, reading (and keeping) the earlier ones first; a posted
        command's error read on the way is raised here."""
        while ticket not in self._early:
            answer = self._receive()
            if self._read in self._posted:
                self._posted.discard(self._read)
                if isinstance(answer, HostError):
                    self._read += 1
                    raise answer
            else:
                self._early[self._read] = answer
            self._read += 1
        answer = self._early.pop(ticket)
        if isinstance(answer, HostError):
            raise answer
        return answer

    def _receive(self) -> Any:
        """The host's next answer; a host that went away or stays silent past `timeout_s` is a
        `HostError`, which the rollout treats like any engine failure (instance out, its
        requests requeued)."""
        if not self.connection.poll(self.timeout_s):
            raise HostError(f"{self.name}: no answer in {self.timeout_s:g} s")
        try:
            return self.connection.recv()
        except (EOFError, OSError) as e:
            raise HostError(f"{self.name}: the connection ended ({e!r})") from e

    def call(self, command: str, *args: Any) -> Any:
        return self.wait(self.send(command, *args))

    def post(self, command: str, *args: Any) -> None:
        """Sends a command whose answer is only success or failure, without waiting for it: the
        host runs commands in order, so the next one sees its effect, and the controller saves
        a round trip. A failure is raised by the next answer waited for, which for a decode
        state is the next read-back (an engine error there takes the instance out)."""
        self._posted.add(self.send(command, *args))

    def release(self, key: int) -> None:
        self._released.append(key)

    def _handle(self, nbytes: int = 0, owned: bool = True) -> HostHandle:
        return HostHandle(self, next(self._keys), nbytes, owned)

    # -- params --

    def place(self, host_tree: Any, base: HostHandle | None = None) -> HostHandle:
        """Puts params (host arrays) on the host's devices; with `base` (`keep_base`), they are
        a LoRA version's adapters, merged there onto that base."""
        from dora_jax.runtime import transfer_lib

        if base is not None and base.engine is not self:
            raise ValueError(f"{self.name}: a base held by {base.engine.name} is not here")
        handle = self._handle(transfer_lib.tree_nbytes(host_tree))
        if base is None:
            self.call("load", handle.key, host_tree)
        else:
            self.call("load_onto", handle.key, base.key, host_tree)
        return handle

    def keep_base(self, params: HostHandle) -> HostHandle | None:
        """A handle to the frozen base of the LoRA policy `params` holds on the host (None for
        a policy without adapters): the base never changes in a run, so later versions can
        move as their adapters alone (`place(adapters, base)`)."""
        base = self._handle()
        nbytes = self.call("keep_base", base.key, params.key)
        if nbytes is None:
            return None
        base.nbytes = nbytes
        return base

    def load_params(self, version: int = 0) -> Any:
        from dora_jax.engine.slots_lib import PolicyParams

        handle = self._handle()
        self.call("load_model", handle.key)
        return PolicyParams(handle, version)

    # -- decoding --

    def init_decode_state(self) -> HostHandle:
        state = self._handle(owned=False)
        self.call("init", state.key)
        return state

    def bucket_for(self, length: int) -> int:
        from dora_jax.engine import engine_lib

        return engine_lib.bucket_for(self.prefill_buckets, length)

    def admit(
        self, params: Any, state: HostHandle, requests: Sequence[Any], slots: Sequence[int]
    ) -> tuple[HostHandle, PendingResult]:
        new = self._handle(owned=False)
        ticket = self.send(
            "admit", params.state.key, params.version, state.key, new.key, list(requests),
            list(slots),
        )  # fmt: skip
        return new, PendingResult(self, ticket)

    def generate_steps(
        self, params: Any, state: HostHandle, steps: int
    ) -> tuple[HostHandle, PendingResult]:
        new = self._handle(owned=False)
        ticket = self.send(
            "generate_steps", params.state.key, params.version, state.key, new.key, steps
        )
        return new, PendingResult(self, ticket)

    def free_slot(self, state: HostHandle, slot: int) -> HostHandle:
        new = self._handle(owned=False)
        self.post("free", state.key, new.key, slot)
        return new

    def export_slot(self, state: HostHandle, slot: int) -> HostHandle:
        exported = self._handle()
        exported.nbytes = self.call("export", state.key, exported.key, slot)
        return exported

    def import_slot(self, state: HostHandle, slot: int, exported: Any) -> HostHandle:
        from dora_jax.runtime import transfer_lib

        key = None
        if isinstance(exported, HostHandle):
            if exported.engine is self:
                exported, key = None, exported.key
            else:  # a slot of another host travels through the controller
                try:
                    exported = exported.fetch()
                except HostError as e:  # the source's fault (a posted free of its, say)
                    raise transfer_lib.SourceError(
                        f"{exported.engine.name}: could not read the slot ({e})"
                    ) from e
        new = self._handle(owned=False)
        self.post("import", state.key, new.key, slot, exported, key)
        return new

    def close(self) -> None:
        """Ends the host (it returns when its connection closes). Answers to posted commands
        are read first, briefly: over TCP, closing with one unread resets the connection."""
        self._released.clear()
        try:
            while self._posted and self.connection.poll(min(self.timeout_s, 5.0)):
                self.connection.recv()
                self._posted.discard(self._read)
                self._read += 1
        except (EOFError, OSError):
            pass
        self.connection.close()
        if self.process is not None:
            self.process.join(timeout=60)


def start_local_hosts(
    specs: Sequence[EngineSpec], timeout_s: float = ANSWER_TIMEOUT_S
) -> list[RemoteEngine]:
    """Starts one generation host per spec as a child process of this machine (a fresh
    interpreter each: a forked JAX runtime is not safe) and connects to each; a host silent
    for `timeout_s` counts as hung."""
    context = multiprocessing.get_context("spawn")
    engines = []
    for i, spec in enumerate(specs):
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, args=(theirs, spec), daemon=True, name=f"host{i}")
        process.start()
        theirs.close()
        engines.append(RemoteEngine(ours, process, name=f"host{i}", timeout_s=timeout_s))
    return engines


def parse_address(address: str, field: str = "address") -> tuple[str, int]:
    """`HOST:PORT` as (host, port); a malformed one is an error naming `field`."""
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {address!r} is not HOST:PORT")
    return host, int(port)


def host_key() -> bytes:
    """The shared key of controller and network hosts, from `DORA_JAX_HOST_KEY`."""
    import os

    key = os.environ.get(KEY_VARIABLE, "")
    if not key:
        raise ValueError(
            f"network generation hosts need a shared key: set {KEY_VARIABLE} to the same secret "
            "on the controller and on every host"
        )
    return key.encode()


def connect_hosts(
    addresses: Sequence[str], specs: Sequence[EngineSpec], timeout_s: float = ANSWER_TIMEOUT_S
) -> list[RemoteEngine]:
    """Connects to running hosts (`dora-jax host`), one per spec, and gives each its engine; a
    host silent for `timeout_s` counts as hung."""
    from multiprocessing.connection import Client

    key = host_key()
    engines = []
    for address, spec in zip(addresses, specs, strict=True):
        connection = Client(parse_address(address), authkey=key)
        connection.send(spec)
        engines.append(RemoteEngine(connection, name=address, timeout_s=timeout_s))
    return engines


def listen(address: str) -> None:
    """`dora-jax host`: serves controllers at `address` until killed, in the role each one's
    first message gives. As a generation host (an `EngineSpec`) it serves them one after
    another; as a training host (`training_hosts_lib.TrainingSpec`) it joins that controller's
    process group, which a process can do once, and returns when the run ends."""
    from multiprocessing.connection import Listener

    from dora_jax.runtime import training_hosts_lib

    with Listener(parse_address(address, "--address"), authkey=host_key()) as listener:
        print(f"host listening on {address}", flush=True)
        while True:
            try:
                connection = listener.accept()
                spec = connection.recv()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as e:
                print(f"refused a connection: {e!r}", flush=True)
                continue
            with connection:
                if isinstance(spec, training_hosts_lib.TrainingSpec):
                    training_hosts_lib.follow(connection, spec)
                    return
                serve(connection, spec)
