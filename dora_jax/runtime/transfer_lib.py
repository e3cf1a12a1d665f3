"""Weight transfer between meshes: the one place a policy version's params change devices.

DORA moves weights on every version change: the trainer publishes a new version onto a
generation mesh, and an instance that needs a version some other instance already holds copies
it from there instead (DESIGN.md, orchestrator step 3). Both are the same operation: place a
pytree with another mesh's shardings, wait until it is there, and account for the seconds and
bytes, which the rollout reports as weight-move time. In one controller (the Pathways shape)
`jax.device_put` across meshes is that copy. A generation host in a process of its own
(`hosts_lib`) is reached through host arrays instead: its engine's shardings are a
`RemoteTarget`, and the params it holds are a `HostHandle`, fetched when another mesh needs them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.runtime.hosts_lib import HostHandle, RemoteTarget


class SourceError(RuntimeError):
    """The params could not be read from the generation host holding them: the fault is the
    source's, not the target's, so the caller takes the source out, not the instance loading."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    tree: Any  # the placed pytree
    seconds: float  # until every leaf was on its target devices
    nbytes: int  # bytes of the placed pytree, over all its leaves


def tree_nbytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (its global size, not per device)."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def cast(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves (JAX or NumPy arrays) in `dtype` (None: as they
    are). A JAX array is cast where it lives, so what moves afterwards is the smaller copy."""

    def one(x: Any) -> Any:
        if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree.map(one, tree)


def put(tree: Any, shardings: Any, *, copy: bool = False, dtype: Any = None) -> Transfer:
    """Places `tree` with `shardings` (a matching pytree) and waits until it is there.

    `copy=True` always makes fresh buffers: the trainer donates its params to its next step, so
    a published version must not alias them. Without it, leaves already placed as asked are
    reused, which makes loading a version the trainer published straight onto this mesh free.
    `dtype` casts floating-point leaves before they move (`cast`): a generation engine holds
    its params in the dtype it computes in, not in the trainer's float32.
    """
    if isinstance(shardings, RemoteTarget):
        return _put_remote(tree, shardings, copy, dtype)
    start = time.perf_counter()
    if isinstance(tree, HostHandle):
        tree = _fetch(tree, adapters_only=False)
    tree = cast(tree, dtype)
    placed = jax.device_put(tree, shardings, may_alias=False if copy else None)
    if copy:
        placed = jax.tree.map(_unshare, tree, placed)
    jax.block_until_ready(placed)
    return Transfer(placed, time.perf_counter() - start, tree_nbytes(placed))


def put_onto_base(
    tree: Any, shardings: Any, base: Any, *, copy: bool = False, dtype: Any = None
) -> Transfer:
    """`tree`'s LoRA adapters placed as `put` places them, merged onto `base`: a LoRA policy's
    frozen params, already where `shardings` say and in `dtype` (on a generation host, the
    handle `RemoteEngine.keep_base` gave). LoRA versions differ in their adapters alone, so a
    version moves onto a base held there as its adapters (`nbytes` counts those)."""
    if isinstance(shardings, RemoteTarget):
        return _put_remote(tree, shardings, copy, dtype, base)
    adapters = nnx.filter_state(tree, nnx.LoRAParam)
    target = nnx.filter_state(shardings, nnx.LoRAParam)
    moved = put(adapters, target, copy=copy, dtype=dtype)
    return dataclasses.replace(moved, tree=nnx.merge_state(base, moved.tree))


def _put_remote(
    tree: Any, target: RemoteTarget, copy: bool, dtype: Any, base: HostHandle | None = None
) -> Transfer:
    """`put` (`base` None) or `put_onto_base` onto a generation host: the params travel as
    host arrays, and params already on that host stay where they are."""
    start = time.perf_counter()
    if isinstance(tree, HostHandle):
        if tree.engine is target.engine and not copy:
            return Transfer(tree, time.perf_counter() - start, tree.nbytes)
        tree = _fetch(tree, adapters_only=base is not None)
    elif base is not None:
        tree = nnx.filter_state(tree, nnx.LoRAParam)
    placed = target.engine.place(jax.device_get(cast(tree, dtype)), base)
    return Transfer(placed, time.perf_counter() - start, placed.nbytes)


def _fetch(handle: HostHandle, adapters_only: bool) -> Any:
    try:
        return handle.fetch(adapters_only)
    except Exception as e:
        raise SourceError(f"{handle.engine.name}: could not read its params ({e})") from e


def _buffers(x: Any) -> set[int]:
    if not isinstance(x, jax.Array) or x.is_deleted():
        return set()
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _unshare(source: Any, placed: Any) -> Any:
    """`placed` in buffers of its own. JAX (0.10) places an array that lives on one device
    onto a sharding replicated over several by reusing its buffer for that device's shard,
    even with `may_alias=False`; a copy on the same sharding does not. Donating such a shard
    (the trainer's step) would delete the source's buffer, or a reference policy placed from
    the same model."""
    if _buffers(source) & _buffers(placed):
        return jax.device_put(placed, placed.sharding, may_alias=False)
    return placed
