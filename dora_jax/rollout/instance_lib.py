"""A rollout instance: one generation mesh, one engine, its decode slots, one version at a time.

The instance holds a real copy of its version's params on its own devices; loading another
version replaces (and so frees) it. It drives the engine through `admit` (a batched prefill
straight into free slots) and `generate_steps` (a turn's decode steps as one call), plus the
slot moves DORA needs (`export_slot`, `import_slot`, `free_slot`); params are the engine's
`PolicyParams` (state + version), moved onto the engine's `param_shardings` by
`runtime.transfer_lib`, and each token's version is the engine's tag on its result.
`dispatch_prefill` and `dispatch_generate` only enqueue work (JAX async dispatch) and one
`collect` reads it all back, so the controller starts every instance's admissions and decode
steps before it reads any token: that is where generation meshes overlap with each other and
with the trainer, and a turn that admits requests costs no extra host round trip.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from dora_jax.engine.request_lib import FinishReason
from dora_jax.engine.request_lib import Request as EngineRequest
from dora_jax.engine.slots_lib import PolicyParams
from dora_jax.models import lora_lib
from dora_jax.rollout.request_lib import Request
from dora_jax.runtime import transfer_lib
from dora_jax.runtime.hosts_lib import RemoteTarget


def read_rows(result: Any) -> list[tuple[int, float, int]]:
    """(token, behaviour log-prob, finish reason) of every row of a host-side ResultTokens, as
    Python numbers; finish reason 0 (`FinishReason.NONE`) means the request goes on. One pass
    over the whole step's columns: reading slot by slot cost more than the step's dispatch."""
    return list(
        zip(
            result.tokens.tolist(),
            np.asarray(result.log_probs).reshape(-1).tolist(),
            result.finish_reasons.tolist(),
            strict=True,
        )
    )


class RolloutInstance:
    def __init__(self, index: int, engine: Any):
        self.index = index
        self.engine = engine
        self.version: int | None = None
        self.params: Any = None  # the engine's PolicyParams of `version`, on this mesh
        self.slots: list[Request | None] = [None] * engine.max_concurrent_decodes
        self.decode_state = engine.init_decode_state()
        self.healthy = True
        self._base: Any = None  # a LoRA policy's frozen base, once moved here (`load`)
        self._pending_result: Any = None
        self._pending_prefill: list[Any] = []
        # Slots whose request a stop string ended: the engine decodes on in them until freed.
        self._stopped: list[int] = []
        self._leaving: list[Request] = []  # finished in the read-back `collect` is recording
        # Engine calls waiting for the params of the version `expect` took up (None: none due).
        self._awaiting: list[Callable[[], None]] | None = None

    @property
    def name(self) -> str:
        return f"instance{self.index}"

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def active(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is not None]

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is None]

    def kv_tokens(self) -> int:
        """Positions held in the KV cache (prompt + generated) over all busy slots."""
        return sum(len(r.prompt.tokens) + len(r.tokens) for r in self.slots if r is not None)

    @property
    def base(self) -> Any | None:
        """A LoRA policy's frozen params as this instance holds them (None before its first
        version and without LoRA; on a generation host, a `HostHandle` to them there): the
        trainer publishes a version staged here as adapters on this base."""
        return self._base

    def load(self, version: int, state: Any) -> tuple[float, int]:
        """Hosts `version`: places its params `state` (the trainer's published copy, or
        another instance's) on this mesh. Returns (seconds, bytes). Dropping the previous
        version's copy frees it.

        A LoRA policy's versions differ in their adapters alone, and its base never changes in
        a run (a `Rollout` makes its instances after the trainer's restore, and the warm-up
        before it trains adapters only): an instance in this process keeps the base of its
        first version, and every later version moves (and holds a copy of) its adapters only.
        So does one on a generation host, once it has loaded a version from this process (a
        version copied from another host's first travels whole).
        """
        if self.active():
            raise RuntimeError(f"{self.name}: cannot switch versions with requests in its slots")
        return self._place(version, state)

    def _place(self, version: int, state: Any) -> tuple[float, int]:
        self.params = None
        target, dtype = self.engine.param_shardings, self.engine.param_dtype
        remote = isinstance(target, RemoteTarget)
        if self._base is not None and (remote or isinstance(state, nnx.State)):
            moved = transfer_lib.put_onto_base(state, target, self._base, dtype=dtype)
        else:
            start = time.perf_counter()
            moved = transfer_lib.put(state, target, dtype=dtype)
            self._base = self._base_of(state, moved.tree)  # on a host, one more round trip
            moved = dataclasses.replace(moved, seconds=time.perf_counter() - start)
        self.params = PolicyParams(moved.tree, version=version)
        self.version = version
        return moved.seconds, moved.nbytes

    def _base_of(self, state: Any, placed: Any) -> Any | None:
        """The frozen base of a version just placed whole, None without adapters. On a
        generation host, `placed` is a handle, so whether the policy has adapters is read from
        `state`, known only where it came from this process."""
        if isinstance(placed, nnx.State):
            return lora_lib.frozen_base(placed)
        if isinstance(state, nnx.State) and lora_lib.frozen_base(state) is not None:
            return self.engine.keep_base(placed)
        return None

    def expect(self, version: int) -> None:
        """Hosts `version` before its params are here (the trainer is still finishing it):
        slots take requests from now on, and their engine calls wait for `receive`. The
        controller receives them once every other instance's decode steps of the turn are
        enqueued, so those decode while it waits for the trainer."""
        if self.active():
            raise RuntimeError(f"{self.name}: cannot switch versions with requests in its slots")
        self.params = None
        self.version = version
        self._awaiting = []

    @property
    def expecting(self) -> bool:
        return self._awaiting is not None

    def receive(self, state: Any) -> tuple[float, int]:
        """Places the expected version's params (as `load`), then enqueues the engine calls
        that waited for them. Returns (seconds, bytes) of the placing."""
        if self._awaiting is None or self.version is None:
            raise RuntimeError(f"{self.name}: expects no params")
        waiting, self._awaiting = self._awaiting, None
        moved = self._place(self.version, state)
        for call in waiting:
            call()
        return moved

    def unload(self) -> None:
        """Frees the hosted version's params (its version retired)."""
        self.params = None
        self.version = None
        self._awaiting = None

    def dispatch_prefill(self, starts: list[tuple[Request, int]]) -> None:
        """Enqueues the admission of every (request, slot) pair: prompt plus anything the
        request generated so far, prefilled straight into its slot, one engine call per prefill
        length bucket (so a re-prefilled long request does not pad short ones to its length).
        The slots are taken from now on. Does not wait: the next `collect` reads the first
        tokens back together with the decode step enqueued after them."""
        for _, slot in starts:
            if self.slots[slot] is not None:
                raise RuntimeError(f"{self.name}: slot {slot} is busy")
        if self._awaiting is not None:
            self._awaiting.append(functools.partial(self._enqueue_admissions, starts))
        else:
            self._enqueue_admissions(starts)
        for request, slot in starts:
            self.slots[slot] = request

    def _enqueue_admissions(self, starts: list[tuple[Request, int]]) -> None:
        self._free_stopped()
        by_bucket: dict[int, list[tuple[Request, int, EngineRequest]]] = {}
        for request, slot in starts:
            tokens = np.concatenate(
                [np.asarray(request.prompt.tokens, np.int32), np.asarray(request.tokens, np.int32)]
            )
            engine_request = EngineRequest(
                prompt_tokens=tokens,
                max_new_tokens=request.max_new_tokens - len(request.tokens),
                ignore_eos=request.prompt.ignore_eos,
                seed=request.prefill_seed(),
                id=request.key,
            )
            bucket = self.engine.bucket_for(len(tokens))
            by_bucket.setdefault(bucket, []).append((request, slot, engine_request))
        for group in by_bucket.values():
            self.decode_state, result = self.engine.admit(
                self.params, self.decode_state, [e for _, _, e in group], [s for _, s, _ in group]
            )
            result.copy_to_host_async()
            self._pending_prefill.append(([(r, s) for r, s, _ in group], result))

    def dispatch_generate(self, steps: int) -> None:
        """Enqueues `steps` decode steps for every slot as one engine call (does not wait)."""
        self._check_not_expecting()
        self._free_stopped()
        self.decode_state, self._pending_result = self.engine.generate_steps(
            self.params, self.decode_state, steps
        )

    def collect(self) -> tuple[list[Request], list[int]]:
        """Reads back what was enqueued since the last collect, in order: the admissions' first
        tokens, then each decode step's tokens. Returns the requests that finished (slots
        freed) and, for each step the engine ran, how many of its slots held a request; a slot
        whose request a stop string ended decodes on, for nothing, until the call's last step.

        Everything is read before any slot changes: a read-back that raises (a device error, a
        generation host gone) leaves every request in its slot as it was before the turn, so
        `fail` hands them all back. Recording as it read, a request that finished in an earlier
        read-back of the turn would already have left its slot, and be lost with the error."""
        admissions, self._pending_prefill = self._pending_prefill, []
        pending, self._pending_result = self._pending_result, None
        admitted = [(starts, result.convert_to_numpy()) for starts, result in admissions]
        steps = pending.convert_to_numpy()
        for starts, result in admitted:
            refused = [slot for (_, slot), ok in zip(starts, result.valid, strict=False) if not ok]
            if refused:
                raise RuntimeError(f"{self.name}: engine refused busy slot(s) {refused}")
        # Requests leave their slots here as they finish: until `collect` returns them, an error
        # recording a later row (a stop string's text) must not lose them, so `fail` has them.
        finished = self._leaving
        for starts, result in admitted:
            rows = read_rows(result)
            for row, (request, slot) in enumerate(starts):
                request.started = True
                self._record(slot, rows[row], result.version, finished)
        busy_per_step = []
        for result in steps:
            if not result.valid.any():  # every slot had finished: the program stopped
                break
            active = self.active()
            busy_per_step.append(len(active))
            rows = read_rows(result) if active else []
            for slot in active:
                self._record(slot, rows[slot], result.version, finished)
        self._leaving = []
        return finished, busy_per_step

    def _record(
        self, slot: int, row: tuple[int, float, int], version: int, finished: list[Request]
    ) -> None:
        """Appends a (token, log-prob, finish reason) row to the request in `slot`; a finished
        request leaves its slot (the engine already stopped it) and joins `finished`."""
        request = self.slots[slot]
        token, logprob, finish = row
        request.record(token, logprob, version)
        # A stop string completed by the last token allowed ends the request too, untruncated.
        stopped = finish in (FinishReason.NONE, FinishReason.LENGTH) and (
            request.stop is not None and request.stop.step(token)
        )
        if finish != FinishReason.NONE or stopped:
            request.truncated = finish == FinishReason.LENGTH and not stopped
            self.slots[slot] = None
            finished.append(request)
            if finish == FinishReason.NONE:
                self._stopped.append(slot)

    def _free_stopped(self) -> None:
        """Frees the engine's slots of requests that stop strings ended, in one call, before
        the next call that decodes or fills slots. Not at once: `collect` has already handed
        those requests back, and an engine error there would lose them with the instance."""
        if self._stopped:
            self.decode_state = self.engine.free_slot(self.decode_state, self._stopped)
            self._stopped = []

    def _release(self, slot: int) -> None:
        self.decode_state = self.engine.free_slot(self.decode_state, slot)
        self.slots[slot] = None

    def export(self, slot: int) -> tuple[Request, Any]:
        """Moves a request's decoding state out (for a migration); the slot becomes free."""
        self._check_not_expecting()
        request = self.slots[slot]
        exported = self.engine.export_slot(self.decode_state, slot)
        self._release(slot)
        return request, exported

    def import_(self, slot: int, request: Request, exported: Any) -> None:
        """Installs an exported request; it continues without re-prefill."""
        if request.version != self.version:
            raise RuntimeError(
                f"{self.name} hosts v{self.version}, cannot take a v{request.version} request"
            )
        self._check_not_expecting()
        self._free_stopped()
        self.decode_state = self.engine.import_slot(self.decode_state, slot, exported)
        self.slots[slot] = request

    def evict_all(self) -> list[Request]:
        """Takes every request out of the slots, keeping what they generated. One engine call:
        if it raises, every request is still in its slot for `fail`."""
        self._check_not_expecting()
        active = self.active()
        if active or self._stopped:
            self.decode_state = self.engine.free_slot(self.decode_state, [*self._stopped, *active])
            self._stopped = []
        requests = [self.slots[s] for s in active]
        for s in active:
            self.slots[s] = None
        return requests

    def fail(self) -> list[Request]:
        """Marks the instance dead after an error; returns its requests (state untrusted), those
        that finished in a read-back that failed half-way included."""
        self.healthy = False
        requests = [*self._leaving, *(r for r in self.slots if r is not None)]
        self._leaving = []
        self.slots = [None] * self.num_slots
        self.unload()
        self._base = None
        self._pending_result = None
        self._pending_prefill = []
        self._stopped = []
        return requests

    def _check_not_expecting(self) -> None:
        if self._awaiting is not None:
            raise RuntimeError(f"{self.name}: its version's params have not arrived")
