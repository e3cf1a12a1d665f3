"""Device planning: split the visible devices into a training mesh and N generation meshes.

DORA runs in one controller that sees every device (the Pathways shape). The trainer owns one
mesh; each rollout instance owns its own, disjoint, generation mesh, so work on different meshes
overlaps through JAX's asynchronous dispatch. The same config keys carve virtual CPU devices
(`--xla_force_host_platform_device_count`) or real TPU/GPU devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from dora_jax.config_fields_lib import is_count
from dora_jax.models import sharding_lib


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    train_mesh: Mesh
    generation_meshes: tuple[Mesh, ...]

    @property
    def num_instances(self) -> int:
        return len(self.generation_meshes)


def _check_positive(name: str, value: int) -> None:
    if not is_count(value, 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def plan_devices(
    devices: Sequence[jax.Device] | None = None,
    *,
    train_devices: int,
    num_instances: int,
    devices_per_instance: int = 1,
    train_tp: int = 1,
    instance_tp: int = 1,
    field_prefix: str = "runtime",
    remote_instances: bool = False,
) -> DevicePlan:
    """Carves `devices` (default: all of them) into disjoint meshes, training mesh first.

    With `remote_instances` the instances' engines run on other machines (`hosts_lib`), which
    bring their own devices: the plan is the training mesh alone.

    Each mesh has the model's ("fsdp", "tp") axes. Errors name the config field to change,
    because a wrong count is the most common mistake when moving a config between machines.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (
        ("train_devices", train_devices),
        ("num_instances", num_instances),
        ("devices_per_instance", devices_per_instance),
        ("train_tp", train_tp),
        ("instance_tp", instance_tp),
    ):
        _check_positive(f"{field_prefix}.{name}", value)
    if train_devices % train_tp:
        raise ValueError(
            f"{field_prefix}.train_tp={train_tp} must divide "
            f"{field_prefix}.train_devices={train_devices}"
        )
    if devices_per_instance % instance_tp:
        raise ValueError(
            f"{field_prefix}.instance_tp={instance_tp} must divide "
            f"{field_prefix}.devices_per_instance={devices_per_instance}"
        )
    local_instances = 0 if remote_instances else num_instances
    needed = train_devices + local_instances * devices_per_instance
    if needed > len(devices):
        raise ValueError(
            f"{field_prefix}.num_instances={num_instances} x "
            f"{field_prefix}.devices_per_instance={devices_per_instance} plus "
            f"{field_prefix}.train_devices={train_devices} needs {needed} devices, "
            f"only {len(devices)} are visible"
        )
    train = sharding_lib.make_mesh(
        devices[:train_devices], fsdp=train_devices // train_tp, tp=train_tp
    )
    meshes = []
    for i in range(local_instances):
        start = train_devices + i * devices_per_instance
        chunk = devices[start : start + devices_per_instance]
        meshes.append(
            sharding_lib.make_mesh(chunk, fsdp=devices_per_instance // instance_tp, tp=instance_tp)
        )
    return DevicePlan(train_mesh=train, generation_meshes=tuple(meshes))
