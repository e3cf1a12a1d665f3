"""Logical-axis sharding: parameter axis names -> mesh axes, by rules.

Parameters name their axes (`vocab`, `embed`, `q_heads`, `kv_heads`, `mlp`, `expert`, `norm`);
a rule table maps each name to a mesh axis. FSDP shards `embed` over the `fsdp` axis, tensor
parallelism shards heads / mlp / vocab over `tp`. A dimension that the mesh axis does not divide
stays replicated, so tiny test models shard on any mesh without special cases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("fsdp", "tp")

DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "tp",
    "embed": "fsdp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert": None,
    "norm": None,
}


def make_mesh(devices: Sequence[jax.Device], fsdp: int, tp: int) -> Mesh:
    """A (fsdp, tp) mesh over `devices`; fsdp * tp must equal their number."""
    if fsdp * tp != len(devices):
        raise ValueError(
            f"mesh fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices, got {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(fsdp, tp), MESH_AXES)


def partition_spec(
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> PartitionSpec:
    spec = []
    used: set[str] = set()
    for dim, name in zip(shape, logical_axes, strict=True):
        axis = rules.get(name) if name is not None else None
        # An axis of one device shards nothing, and jit hands it back dropped: left in, the
        # same sharding is spelled two ways and every program taking it compiles twice.
        if axis is None or axis in used or dim % mesh.shape[axis] or mesh.shape[axis] == 1:
            spec.append(None)
        else:
            spec.append(axis)
            used.add(axis)
    while spec and spec[-1] is None:  # P(None,) is P(), as jit hands it back
        spec.pop()
    return PartitionSpec(*spec)


def param_shardings(
    model_or_state: Any, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> Any:
    """A pytree of NamedShardings matching `nnx.state(model)` (or a state already split)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def one(variable: Any) -> Any:
        if not isinstance(variable, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        axes = variable.get_metadata().get("logical_axes")
        shape = variable.shape
        if axes is None:
            return variable.replace(NamedSharding(mesh, PartitionSpec()))
        return variable.replace(NamedSharding(mesh, partition_spec(shape, axes, mesh, rules)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> nnx.Module:
    """Moves `model`'s parameters onto `mesh` in place, sharded by the rules."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def row_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """Batch rows split over `fsdp` when it divides them, else replicated: `runtime` allows any
    fsdp (3 devices give fsdp=3), and JAX refuses to split rows unevenly. Replicated rows give
    the same result, each device computing on the whole batch."""
    spec = PartitionSpec("fsdp") if rows % mesh.shape["fsdp"] == 0 else PartitionSpec()
    return NamedSharding(mesh, spec)
