"""Cheap test doubles for the engine and trainer that honour their contracts.

`EngineDouble` has the generation engine's interface (JetStream's `prefill` / `insert` /
`generate` plus `free_slot`, `export_slot`, `import_slot`): fixed slots, one token per slot per
decode step, per-request forced length (`max_new_tokens` with `ignore_eos`), and slot state that
can be exported from one engine and imported into another. Its tokens are a pure function of
(seed, token index) and each log-prob encodes the version stored *in the params it was given*,
so tests can recover which version sampled every token without trusting the runtime's books.

`TrainerDouble` counts versions and checks every batch's shape (exactly TBS samples in
complete groups, staleness within K) like the real trainer's contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

EOS = 0


def token_at(seed: int, index: int, vocab: int) -> int:
    return int((seed * 2654435761 + index * 40503 + 12345) % (vocab - 1)) + 1


def logprob_of(version: int, seed: int, index: int) -> float:
    """-(version + 1) - a fraction in [0, 0.5): `version_of` inverts it."""
    return -(version + 1) - ((seed + 7 * index) % 50) / 100.0


def version_of(logprob: float) -> int:
    return int(np.floor(-logprob)) - 1


@dataclasses.dataclass
class SlotData:
    tokens: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    done: np.ndarray


class ResultTokens:
    def __init__(self, tokens, logprobs, done, lengths):
        self.tokens, self.logprobs = np.asarray(tokens), np.asarray(logprobs)
        self.done, self.lengths = np.asarray(done), np.asarray(lengths)

    def get_result_at_slot(self, slot: int) -> SlotData:
        return SlotData(
            tokens=self.tokens[slot : slot + 1, None],
            valid=np.ones((1, 1), bool),
            lengths=self.lengths[slot : slot + 1],
            logprobs=self.logprobs[slot : slot + 1, None],
            done=self.done[slot : slot + 1],
        )


_FIELDS = ("active", "seed", "index", "remaining", "ignore_eos", "kv")


class EngineDouble:
    def __init__(
        self,
        mesh: Any,
        *,
        max_concurrent_decodes: int,
        vocab_size: int = 64,
        max_prefill_length: int = 512,
        max_decode_length: int = 512,
        fail_after_steps: int | None = None,
    ):
        self.mesh = mesh
        self.max_concurrent_decodes = max_concurrent_decodes
        self.max_prefill_length = max_prefill_length
        self.max_decode_length = max_decode_length
        self.samples_per_slot = 1
        self.vocab_size = vocab_size
        self.fail_after_steps = fail_after_steps
        self.steps = 0
        self.prefills = 0

    def init_decode_state(self) -> dict[str, np.ndarray]:
        s = self.max_concurrent_decodes
        return {
            "active": np.zeros(s, bool),
            "seed": np.zeros(s, np.int64),
            "index": np.zeros(s, np.int64),
            "remaining": np.zeros(s, np.int64),
            "ignore_eos": np.zeros(s, bool),
            "kv": np.zeros((s, 16), np.float32),  # stands for the slot's KV cache
        }

    @staticmethod
    def _version(params: Any) -> int:
        return int(params["version"])

    def _emit(self, version: int, seed: int, index: int, remaining: int, ignore_eos: bool):
        token = token_at(seed, index, self.vocab_size)
        done = remaining <= 1 or (not ignore_eos and token == EOS)
        return token, logprob_of(version, seed, index), done

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Any = None,
        padded_tokens: np.ndarray,
        true_length: int,
        seed: int = 0,
        max_new_tokens: int = 16,
        ignore_eos: bool = False,
    ):
        if not 0 < true_length <= self.max_prefill_length:
            raise ValueError(f"prompt length {true_length} not in [1, {self.max_prefill_length}]")
        self.prefills += 1
        token, logprob, done = self._emit(
            self._version(params), seed, 0, max_new_tokens, ignore_eos
        )
        prefix = {
            "seed": seed,
            "index": 1,
            "remaining": max_new_tokens - 1,
            "ignore_eos": ignore_eos,
            "kv": np.full(16, float(np.sum(padded_tokens[:true_length])), np.float32),
        }
        return prefix, ResultTokens([token], [logprob], [done], [1])

    def insert(self, prefix: dict, decode_state: dict, slot: int) -> dict:
        if decode_state["active"][slot]:
            raise ValueError(f"slot {slot} is busy")
        state = {k: v.copy() for k, v in decode_state.items()}
        state["active"][slot] = True
        for k in ("seed", "index", "remaining", "ignore_eos", "kv"):
            state[k][slot] = prefix[k]
        return state

    def generate(self, params: Any, decode_state: dict):
        self.steps += 1
        if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
            raise RuntimeError("injected engine failure")
        version = self._version(params)
        state = {k: v.copy() for k, v in decode_state.items()}
        s = self.max_concurrent_decodes
        tokens, logprobs = np.zeros(s, np.int32), np.zeros(s, np.float32)
        done = np.zeros(s, bool)
        for slot in np.flatnonzero(state["active"]):
            tokens[slot], logprobs[slot], done[slot] = self._emit(
                version,
                int(state["seed"][slot]),
                int(state["index"][slot]),
                int(state["remaining"][slot]),
                bool(state["ignore_eos"][slot]),
            )
            state["index"][slot] += 1
            state["remaining"][slot] -= 1
            state["kv"][slot] += tokens[slot]
            if done[slot]:
                state["active"][slot] = False
        return state, ResultTokens(tokens, logprobs, done, state["index"])

    def free_slot(self, decode_state: dict, slot: int) -> dict:
        state = {k: v.copy() for k, v in decode_state.items()}
        state["active"][slot] = False
        return state

    def export_slot(self, decode_state: dict, slot: int) -> dict:
        if not decode_state["active"][slot]:
            raise ValueError(f"slot {slot} is empty")
        return {k: np.copy(decode_state[k][slot]) for k in _FIELDS}

    def import_slot(self, decode_state: dict, slot: int, exported: dict) -> dict:
        if decode_state["active"][slot]:
            raise ValueError(f"slot {slot} is busy")
        state = {k: v.copy() for k, v in decode_state.items()}
        for k in _FIELDS:
            state[k][slot] = exported[k]
        return state


class Published(NamedTuple):
    params: Any
    version: int
    metrics: dict[str, float]


class TrainerDouble:
    """Checks each batch like the real trainer would and turns version v into v + 1."""

    def __init__(self, mesh: Any, *, train_batch_size: int, group_size: int, staleness_bound: int):
        self.tbs, self.g, self.k = train_batch_size, group_size, staleness_bound
        self._params = nnx.State({"w": jnp.ones((4, 4)), "version": jnp.int32(0)})
        self._params = jax.device_put(
            self._params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        self._version = 0
        self.batches: list[list] = []

    @property
    def version(self) -> int:
        return self._version

    @property
    def params(self) -> Any:
        return self._params

    def step(self, batch: list) -> dict[str, float]:
        assert len(batch) == self.tbs, f"batch of {len(batch)}, TBS={self.tbs}"
        groups: dict[int, list[int]] = {}
        for t in batch:
            groups.setdefault(t.prompt_id, []).append(t.sample_index)
            assert 0 <= self._version - t.version <= self.k, (self._version, t.version)
        assert all(sorted(v) == list(range(self.g)) for v in groups.values()), groups
        self.batches.append(batch)
        return {"loss": 0.0}

    def publish(self, target_shardings: Any | None = None) -> Published:
        self._version += 1
        self._params = nnx.State(
            {"w": self._params["w"] + 1.0, "version": jnp.int32(self._version)}
        )
        params = jax.device_put(self._params, target_shardings, may_alias=False)
        return Published(params, self._version, {"publish_seconds": 0.0})
