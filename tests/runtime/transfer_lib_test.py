import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.models import sharding_lib
from dora_jax.runtime import transfer_lib

TRAIN = sharding_lib.make_mesh(jax.devices()[:2], fsdp=2, tp=1)
GENERATE = sharding_lib.make_mesh(jax.devices()[4:8], fsdp=1, tp=4)


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.RandomState(0)
    return {
        "embed": rng.randn(8, 12).astype(np.float32),
        "layers": {"w": rng.randn(4, 8).astype(np.float32), "b": np.arange(6, dtype=np.int32)},
    }


def _on(mesh, tree, spec_of):
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x)), tree)
    return jax.device_put(tree, shardings), shardings


def _rows(x: np.ndarray) -> PartitionSpec:
    return PartitionSpec("fsdp") if x.ndim == 2 else PartitionSpec()


def _columns(x: np.ndarray) -> PartitionSpec:
    return PartitionSpec(None, "tp") if x.ndim == 2 else PartitionSpec()


def test_moves_every_leaf_to_the_other_mesh_shard_by_shard():
    host = _tree()
    source, _ = _on(TRAIN, host, _rows)
    _, target = _on(GENERATE, host, _columns)
    moved = transfer_lib.put(source, target)
    assert moved.nbytes == sum(x.nbytes for x in jax.tree.leaves(host))
    assert moved.seconds >= 0
    for got, want, sharding in zip(
        jax.tree.leaves(moved.tree), jax.tree.leaves(host), jax.tree.leaves(target), strict=True
    ):
        assert got.sharding.device_set == set(jax.devices()[4:8])
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        for shard in got.addressable_shards:  # each device holds exactly its slice
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_copy_never_aliases_the_source():
    host = _tree()
    source, shardings = _on(TRAIN, host, _rows)
    copied = transfer_lib.put(source, shardings, copy=True).tree
    for x in jax.tree.leaves(source):
        x.delete()  # what donating the trainer's params to its next step does to them
    for got, want in zip(jax.tree.leaves(copied), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_copy_from_one_device_onto_a_replicated_sharding_is_a_copy_too():
    """JAX reuses the source's buffer for its own device's shard here, even asked not to."""
    host = _tree()
    source = jax.device_put(host, jax.devices()[0])
    replicated = jax.tree.map(lambda _: NamedSharding(TRAIN, PartitionSpec()), host)
    copied = transfer_lib.put(source, replicated, copy=True).tree
    for x in jax.tree.leaves(copied):
        x.delete()  # the trainer donating its params
    for got, want in zip(jax.tree.leaves(source), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_without_copy_a_tree_already_in_place_is_reused():
    source, shardings = _on(GENERATE, _tree(), _columns)
    moved = transfer_lib.put(source, shardings).tree
    for got, was in zip(jax.tree.leaves(moved), jax.tree.leaves(source), strict=True):
        pointers = [s.data.unsafe_buffer_pointer() for s in got.addressable_shards]
        assert pointers == [s.data.unsafe_buffer_pointer() for s in was.addressable_shards]


def test_tree_nbytes_counts_array_leaves_only():
    tree = {"a": np.zeros((3, 5), np.float32), "b": [np.zeros(7, np.int8), 3], "c": None}
    assert transfer_lib.tree_nbytes(tree) == 3 * 5 * 4 + 7
