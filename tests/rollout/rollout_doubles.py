"""Cheap test doubles for the engine and trainer that honour their contracts.

`EngineDouble` has `dora_jax.engine.Engine`'s interface and semantics (batched `prefill_requests`
and `admit`, JetStream's `insert` / `generate`, `generate_steps`, `param_shardings` and
`shard_params` giving `PolicyParams`, `free_slot`, `export_slot`, `import_slot`, `ResultTokens`
with per-slot finish reasons and behaviour log-probs): fixed slots, one token per busy slot per
decode step, per-request forced length (`max_new_tokens` with `ignore_eos`), inserting into a
busy slot is an error, a finished slot stops by itself. Its tokens are a pure function of (seed,
token index) like the real sampler's PRNG keys, and each log-prob encodes the version stored *in
the weights it was given*, so tests recover which version sampled every token without trusting
anybody's bookkeeping.

`TrainerDouble` counts versions and checks each batch like the real trainer's contract
(exactly TBS samples in complete groups, staleness within K).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.engine.request_lib import FinishReason
from dora_jax.engine.slots_lib import PolicyParams

EOS = 0
VOCAB = 64


def token_at(seed: int, index: int, vocab: int = VOCAB) -> int:
    return int((seed * 2654435761 + index * 40503 + 12345) % (vocab - 1)) + 1


def logprob_of(version: int, seed: int, index: int) -> float:
    """-(version + 1) - a fraction in [0, 0.5): `version_of` inverts it."""
    return -(version + 1) - ((seed + 7 * index) % 50) / 100.0


def version_of(logprob: float) -> int:
    return int(np.floor(-logprob)) - 1


@dataclasses.dataclass
class ResultTokens:
    tokens: np.ndarray
    log_probs: np.ndarray
    finish: np.ndarray
    lengths: np.ndarray
    slot_versions: np.ndarray
    version: int
    error: str | None = None  # raised on read-back, as JAX raises a device error
    valid: np.ndarray | None = None  # rows that hold a token (all, unless set)

    def __post_init__(self) -> None:
        if self.valid is None:
            self.valid = np.ones(len(self.tokens), bool)

    def copy_to_host_async(self) -> None:
        pass  # already on the host

    def convert_to_numpy(self) -> ResultTokens:
        if self.error is not None:
            raise RuntimeError(self.error)
        return self

    @property
    def finish_reasons(self) -> np.ndarray:  # the engine's whole-batch view
        return self.finish


@dataclasses.dataclass
class StepResults:
    """The steps one `generate_steps` call ran (the engine's pads skipped steps with rows that
    are not valid; a rollout stops reading at the first step with no valid row either way)."""

    steps: list[ResultTokens]

    def copy_to_host_async(self) -> None:
        pass  # already on the host

    def convert_to_numpy(self) -> list[ResultTokens]:
        return [step.convert_to_numpy() for step in self.steps]


_FIELDS = ("active", "seed", "index", "remaining", "ignore_eos", "version", "kv")


class EngineDouble:
    def __init__(
        self,
        mesh: Any,
        *,
        max_concurrent_decodes: int,
        max_prefill_length: int = 512,
        max_decode_length: int = 512,
        cache_length: int | None = None,
        fail_after_steps: int | None = None,
        fail_after_prefills: int | None = None,
        fail_on_readback: bool = False,
    ):
        self.mesh = mesh
        self.max_concurrent_decodes = max_concurrent_decodes
        self.max_prefill_length = max_prefill_length
        self.max_decode_length = max_decode_length
        self.cache_length = cache_length or max_prefill_length + max_decode_length  # as Engine's
        self.samples_per_slot = 1
        self.param_dtype = np.dtype(np.float32)  # as a float32 model's `Engine`
        self.fail_after_steps = fail_after_steps
        self.fail_after_prefills = fail_after_prefills
        # A decode failure raises at dispatch, or (True) when its tokens are read back, as a
        # device error surfaces in JAX or a dead generation host's in `RemoteEngine`.
        self.fail_on_readback = fail_on_readback
        self.prefill_calls = 0
        self.steps = 0
        self.prefills = 0

    @property
    def param_shardings(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())  # every leaf replicated on the mesh

    def shard_params(self, state: Any, version: int) -> PolicyParams:
        return PolicyParams(jax.device_put(state, self.param_shardings), int(version))

    def init_decode_state(self) -> dict[str, np.ndarray]:
        s = self.max_concurrent_decodes
        state = {k: np.zeros(s, np.int64) for k in _FIELDS if k != "kv"}
        state["active"] = np.zeros(s, bool)
        state["kv"] = np.zeros((s, 16), np.float32)  # stands for the slot's KV cache
        return state

    def _emit(self, weights_version: int, seed: int, index: int, remaining: int, ignore: bool):
        token = token_at(seed, index)
        if remaining <= 1:
            finish = FinishReason.LENGTH
        elif not ignore and token == EOS:
            finish = FinishReason.EOS
        else:
            finish = FinishReason.NONE
        return token, logprob_of(weights_version, seed, index), int(finish)

    def bucket_for(self, length: int) -> int:
        if not 0 < length <= self.max_prefill_length:
            raise ValueError(f"prompt length {length} not in [1, {self.max_prefill_length}]")
        return max(8, 1 << (length - 1).bit_length())

    def prefill_requests(self, params: PolicyParams, requests: list) -> tuple[dict, ResultTokens]:
        """One batched prefill, row i for requests[i], as `Engine.prefill_requests`."""
        if not requests:
            raise ValueError("a prefill needs at least one request")
        self.prefill_calls += 1
        failing = (
            self.fail_after_prefills is not None and self.prefill_calls > self.fail_after_prefills
        )
        weights_version = int(params.state["version"])
        rows = {k: [] for k in _FIELDS}
        out = {"tokens": [], "log_probs": [], "finish": []}
        for request in requests:
            n = len(request.prompt_tokens)
            if not 0 < n <= self.max_prefill_length:
                raise ValueError(f"prompt length {n} not in [1, {self.max_prefill_length}]")
            if not 1 <= request.max_new_tokens <= self.max_decode_length:
                raise ValueError(f"max_new_tokens={request.max_new_tokens} out of range")
            self.prefills += 1
            token, logprob, finish = self._emit(
                weights_version, request.seed, 0, request.max_new_tokens, request.ignore_eos
            )
            for k, v in (("tokens", token), ("log_probs", logprob), ("finish", finish)):
                out[k].append(v)
            row = {
                "active": finish == FinishReason.NONE,
                "seed": request.seed,
                "index": 1,
                "remaining": request.max_new_tokens - 1,
                "ignore_eos": request.ignore_eos,
                "version": params.version,
                "kv": np.full(16, float(np.sum(request.prompt_tokens)), np.float32),
            }
            for k in _FIELDS:
                rows[k].append(row[k])
        n = len(requests)
        result = ResultTokens(
            np.asarray(out["tokens"]),
            np.asarray(out["log_probs"]),
            np.asarray(out["finish"]),
            np.ones(n, np.int64),
            np.full(n, params.version),
            params.version,
            error="injected prefill failure" if failing else None,
        )
        return {k: np.asarray(v) for k, v in rows.items()}, result

    @staticmethod
    def _slots(slot: int | list[int]) -> list[int]:
        return [int(slot)] if np.ndim(slot) == 0 else [int(s) for s in slot]

    @staticmethod
    def _set(decode_state: dict, slots: list[int], rows: dict) -> dict:
        """Row i of `rows` into slots[i]; a busy slot is an error, as in the engine."""
        busy = [s for s in slots if decode_state["active"][s]]
        if busy:
            raise ValueError(f"slots {busy} are busy; free them first")
        state = {k: v.copy() for k, v in decode_state.items()}
        for i, slot in enumerate(slots):
            for k in _FIELDS:
                state[k][slot] = rows[k][i]
        return state

    def insert(self, prefix: dict, decode_state: dict, slot: int | list[int]) -> dict:
        return self._set(decode_state, self._slots(slot), prefix)

    def admit(self, params: PolicyParams, decode_state: dict, requests: list, slots: list):
        """`prefill_requests` into `slots` as `Engine.admit`: a busy slot is left as it is and
        its row comes back not valid."""
        if len(slots) != len(requests):
            raise ValueError(f"{len(requests)} requests for {len(slots)} slots")
        prefix, result = self.prefill_requests(params, requests)
        taken = [i for i, s in enumerate(slots) if not decode_state["active"][s]]
        rows = {k: [v[i] for i in taken] for k, v in prefix.items()}
        state = self._set(decode_state, [slots[i] for i in taken], rows)
        result.valid = np.isin(np.arange(len(slots)), taken)
        return state, result

    def generate(self, params: PolicyParams, decode_state: dict):
        self.steps += 1
        failing = self.fail_after_steps is not None and self.steps > self.fail_after_steps
        if failing and not self.fail_on_readback:
            raise RuntimeError("injected engine failure")
        weights_version = int(params.state["version"])
        state = {k: v.copy() for k, v in decode_state.items()}
        s = self.max_concurrent_decodes
        tokens, logprobs = np.zeros(s, np.int32), np.zeros(s, np.float32)
        finish = np.zeros(s, np.int32)
        for slot in np.flatnonzero(state["active"]):
            tokens[slot], logprobs[slot], finish[slot] = self._emit(
                weights_version,
                int(state["seed"][slot]),
                int(state["index"][slot]),
                int(state["remaining"][slot]),
                bool(state["ignore_eos"][slot]),
            )
            state["index"][slot] += 1
            state["remaining"][slot] -= 1
            state["kv"][slot] += tokens[slot]
            state["active"][slot] = finish[slot] == FinishReason.NONE
        result = ResultTokens(
            tokens,
            logprobs,
            finish,
            state["index"].copy(),
            state["version"].copy(),
            params.version,
            error="injected engine failure" if failing else None,
        )
        return state, result

    def generate_steps(self, params: PolicyParams, decode_state: dict, steps: int):
        """`steps` calls of `generate`, stopping once no slot decodes, as the engine's program."""
        results = []
        for _ in range(steps):
            if not decode_state["active"].any():
                break
            decode_state, result = self.generate(params, decode_state)
            results.append(result)
        return decode_state, StepResults(results)

    def free_slot(self, decode_state: dict, slot: int | list[int]) -> dict:
        state = {k: v.copy() for k, v in decode_state.items()}
        state["active"][self._slots(slot)] = False
        return state

    def export_slot(self, decode_state: dict, slot: int) -> dict:
        if not decode_state["active"][slot]:
            raise ValueError(f"slot {slot} is empty")
        return {k: np.copy(decode_state[k][slot]) for k in _FIELDS}

    def import_slot(self, decode_state: dict, slot: int, exported: dict) -> dict:
        return self._set(decode_state, [slot], {k: [v] for k, v in exported.items()})


class Published(NamedTuple):
    params: Any
    version: int
    metrics: dict[str, float]


class TrainerDouble:
    """Checks each batch like the real trainer would and turns version v into v + 1; the
    version is also written into the weights, so the engine double can read it back."""

    def __init__(self, mesh: Any, *, train_batch_size: int, group_size: int, staleness_bound: int):
        self.tbs, self.g, self.k = train_batch_size, group_size, staleness_bound
        self.mesh = mesh
        self._version = 0
        self._params = self._weights(0)
        self.batches: list[list] = []

    def _weights(self, version: int) -> nnx.State:
        state = nnx.State({"w": jnp.full((4, 4), float(version)), "version": jnp.int32(version)})
        return jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))

    @property
    def version(self) -> int:
        return self._version

    @property
    def params(self) -> Any:
        return self._params

    def restore_version(self, version: int) -> None:
        """What restoring a checkpoint of `version` does to the real trainer."""
        self._version = version
        self._params = self._weights(version)

    def step(self, batch: list) -> dict[str, float]:
        assert len(batch) == self.tbs, f"batch of {len(batch)}, TBS={self.tbs}"
        groups: dict[int, list[int]] = {}
        for t in batch:
            groups.setdefault(t.prompt_id, []).append(t.sample_index)
            assert 0 <= self._version - t.version <= self.k, (self._version, t.version)
        assert all(sorted(v) == list(range(self.g)) for v in groups.values()), groups
        self.batches.append(batch)
        return {"loss": 0.0}

    def publish(
        self, target_shardings: Any | None = None, dtype: Any = None, base: Any | None = None
    ) -> Published:
        del dtype, base  # the double's engines hold float32, as its weights are, and no LoRA
        self._version += 1
        self._params = self._weights(self._version)
        params = jax.device_put(self._params, target_shardings, may_alias=False)
        return Published(params, self._version, {"publish_seconds": 0.0})
