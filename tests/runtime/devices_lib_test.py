import jax
import pytest

from dora_jax.runtime import devices_lib


def test_plan_is_disjoint_and_covers_requested_devices():
    plan = devices_lib.plan_devices(
        train_devices=2, num_instances=3, devices_per_instance=2, instance_tp=2
    )
    assert plan.num_instances == 3
    assert plan.train_mesh.devices.size == 2
    seen = [d.id for d in plan.train_mesh.devices.flat]
    for mesh in plan.generation_meshes:
        assert dict(mesh.shape) == {"fsdp": 1, "tp": 2}
        seen += [d.id for d in mesh.devices.flat]
    assert len(seen) == len(set(seen)) == 8
    assert sorted(seen) == sorted(d.id for d in jax.devices())


def test_more_instances_than_devices_names_the_field():
    with pytest.raises(ValueError, match="num_instances"):
        devices_lib.plan_devices(train_devices=1, num_instances=8)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"train_devices": 0, "num_instances": 1}, "train_devices"),
        ({"train_devices": 2, "num_instances": 1, "train_tp": 3}, "train_tp"),
        (
            {"train_devices": 1, "num_instances": 1, "devices_per_instance": 2, "instance_tp": 4},
            "instance_tp",
        ),
    ],
)
def test_bad_counts_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        devices_lib.plan_devices(**kwargs)
