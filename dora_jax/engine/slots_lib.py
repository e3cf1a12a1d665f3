"""The engine's device-side state and results: `PolicyParams`, `SlotState`, `ResultTokens`
(one step's tokens) and `StepResults` (several steps').

A decode state, a prefill result (`Prefix`) and an exported slot (`ExportedSlot`) are all a
`SlotState` (one row per slot, prompt or migrated request), which is why insert and import are
one operation and a migrated request continues bit-for-bit. `PolicyParams` pairs params with
their policy version so every result is tagged with the version that produced it (C1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from flax import struct

from dora_jax.models import KVCache


@jax.tree_util.register_pytree_node_class
class PolicyParams:
    """Model params plus the policy version they are.

    `version` is static pytree data (so `jax.device_put(p, shardings)` keeps it), but the engine
    hands only `state` to its jitted functions: changing versions never recompiles.
    """

    def __init__(self, state: Any, version: int):
        self.state = state
        self.version = version
        # Flattened once: an nnx state flattens in Python (about 0.15 ms for a small model,
        # measured), which every decode step would otherwise pay on top of its dispatch.
        self.leaves = tuple(jax.tree.leaves(state))

    def tree_flatten(self) -> tuple[tuple[Any], int]:
        return (self.state,), self.version

    @classmethod
    def tree_unflatten(cls, version: int, children: tuple[Any]) -> PolicyParams:
        return cls(children[0], version)

    def __repr__(self) -> str:
        return f"PolicyParams(version={self.version})"


def policy_version(params: Any) -> int:
    """The version that `params` (the engine's PolicyParams) samples as."""
    if not isinstance(params, PolicyParams):
        raise TypeError(
            "engine params must be PolicyParams(state, version) so every token is tagged with "
            f"the policy version that sampled it; got {type(params).__name__}. Use "
            "engine.load_params(version=...) or engine.shard_params(state, version=...)."
        )
    return int(params.version)


# --------------------------------------------------------------------------------------------
# Device-side state
# --------------------------------------------------------------------------------------------


class SlotState(NamedTuple):
    """Per-row decoding state. The decode state has one row per slot; a prefix one per prompt."""

    cache: KVCache  # k, v: per layer [rows, kv_heads, cache_len, head_dim]
    tokens: jax.Array  # int32: the last sampled token, the next step's input
    positions: jax.Array  # int32: the cache index that token will be written at
    generated: jax.Array  # int32: tokens sampled so far (= the next token's PRNG index)
    prompt_length: jax.Array  # int32
    active: jax.Array  # bool: still decoding
    finish_reason: jax.Array  # int32 FinishReason
    version: jax.Array  # int32: policy version of the params that prefilled it
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    seed: jax.Array  # uint32
    max_new_tokens: jax.Array  # int32
    min_new_tokens: jax.Array  # int32
    eos_ids: jax.Array  # int32 [rows, max_eos_ids], padded with -1

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


DecodeState = SlotState
Prefix = SlotState
ExportedSlot = SlotState  # one row


class SlotData(NamedTuple):
    """JetStream's per-slot view (`tokens`, `valid`, `lengths`) plus log-probs and status."""

    tokens: np.ndarray  # [samples, 1]
    valid: np.ndarray  # [samples, 1]
    lengths: np.ndarray  # [samples]: tokens generated so far, this one included
    log_probs: np.ndarray  # [samples, 1]
    finish_reason: np.ndarray  # [samples]: FinishReason after this token (NONE: continues)
    version: np.ndarray  # [samples]: the version that prefilled the slot


RESULT_COLUMNS = ("token", "valid", "length", "finish_reason", "version")


@struct.dataclass
class ResultTokens:
    """Tokens of one prefill or generate call, in JetStream's layout, plus behaviour log-probs.

    `data` packs [rows, token | valid | length | finish_reason | version] into one int32 array
    (one device-to-host copy); `log_probs` is float32 [rows, 1]. `version` is the policy version
    of the params that produced these tokens.
    """

    data: Any
    log_probs: Any
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 1))
    valid_idx: tuple[int, int] = struct.field(pytree_node=False, default=(1, 2))
    length_idx: tuple[int, int] = struct.field(pytree_node=False, default=(2, 3))
    finish_idx: tuple[int, int] = struct.field(pytree_node=False, default=(3, 4))
    version_idx: tuple[int, int] = struct.field(pytree_node=False, default=(4, 5))
    samples_per_slot: int = struct.field(pytree_node=False, default=1)
    version: int = struct.field(pytree_node=False, default=0)

    def copy_to_host_async(self) -> None:
        _copy_to_host_async(self.data, self.log_probs)

    def convert_to_numpy(self) -> ResultTokens:
        return self.replace(data=np.asarray(self.data), log_probs=np.asarray(self.log_probs))

    def get_result_at_slot(self, slot: int) -> SlotData:
        rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
        col = lambda idx: self.data[rows, idx[0] : idx[1]]
        return SlotData(
            tokens=col(self.tokens_idx),
            valid=col(self.valid_idx),
            lengths=col(self.length_idx)[:, 0],
            log_probs=self.log_probs[rows],
            finish_reason=col(self.finish_idx)[:, 0],
            version=col(self.version_idx)[:, 0],
        )

    # Whole-batch views (numpy after `convert_to_numpy`).
    @property
    def tokens(self) -> np.ndarray:
        return self.data[:, self.tokens_idx[0]]

    @property
    def valid(self) -> np.ndarray:
        return self.data[:, self.valid_idx[0]].astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return self.data[:, self.length_idx[0]]

    @property
    def finish_reasons(self) -> np.ndarray:
        return self.data[:, self.finish_idx[0]]


@struct.dataclass
class StepResults:
    """The tokens of several decode steps run as one program (`Engine.generate_steps`).

    `data` is int32 [steps, rows, columns] and `log_probs` float32 [steps, rows, 1], each step in
    `ResultTokens`' layout, so the whole call is two device-to-host copies.
    `convert_to_numpy` gives one host-side `ResultTokens` per step: a row is valid where its
    slot decoded at that step, and a step the program did not run (every slot had finished)
    has no valid row.
    """

    data: Any
    log_probs: Any
    version: int = struct.field(pytree_node=False, default=0)

    def copy_to_host_async(self) -> None:
        _copy_to_host_async(self.data, self.log_probs)

    def convert_to_numpy(self) -> list[ResultTokens]:
        data, log_probs = np.asarray(self.data), np.asarray(self.log_probs)
        return [
            ResultTokens(d, lp, version=self.version) for d, lp in zip(data, log_probs, strict=True)
        ]


def _copy_to_host_async(*arrays: Any) -> None:
    """Starts the device-to-host copy of each array still on a device (JetStream's hook, so a
    later read-back does not wait for the transfer)."""
    for x in arrays:
        if isinstance(x, jax.Array):
            x.copy_to_host_async()
