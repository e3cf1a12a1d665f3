"""`from_pretrained(..., mesh=)` on a 2x2 (fsdp, tp) mesh of virtual CPU devices: each param
lands with the trainer's sharding, holds the checkpoint's values (fp32 and bf16 checkpoints),
and no device ever receives more of a tensor than its own shard."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import make_hf_model
from jax._src.lib import xla_client
from safetensors import safe_open

from dora_jax.models import SUPPORTED_ARCHITECTURES, from_pretrained, save_pretrained, sharding_lib

TOL = 1e-4


def _mesh() -> jax.sharding.Mesh:
    return sharding_lib.make_mesh(jax.devices()[:4], fsdp=2, tp=2)


def _placed_and_expected(model, mesh) -> list[tuple[tuple, jax.Array, jax.sharding.Sharding]]:
    """(path, loaded array, the sharding `param_shardings` gives it) for every param."""
    state = nnx.state(model, nnx.Param)
    expected = dict(nnx.to_flat_state(sharding_lib.param_shardings(state, mesh)))
    return [(k, v.get_value(), expected[k].get_value()) for k, v in nnx.to_flat_state(state)]


def _logits(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))


def _hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.float().numpy()


def _ids() -> np.ndarray:
    return np.random.RandomState(0).randint(0, 97, (2, 24))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_params_land_with_the_trainers_shardings_and_match_transformers(arch, tmp_path):
    hf = make_hf_model(arch, str(tmp_path), seed=11)
    mesh = _mesh()
    model = from_pretrained(str(tmp_path), mesh=mesh)

    placed = _placed_and_expected(model, mesh)
    assert any(s.shard_shape(x.shape) != x.shape for _, x, s in placed), "nothing was sharded"
    for path, array, sharding in placed:
        assert array.sharding == sharding, path
    # Layouts, against the torch tensors themselves: `linear` is transposed, `plain` is not.
    weights = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    layer = model.layers[0].self_attn
    np.testing.assert_array_equal(model.embed_tokens[...], weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        layer.q_proj.kernel[...], weights["model.layers.0.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(model.lm_head[...], weights["lm_head.weight"].T)
    assert np.abs(_logits(model, _ids()) - _hf_logits(hf, _ids())).max() <= TOL


def test_bfloat16_checkpoint_loads_exactly_onto_the_mesh(tmp_path):
    hf = make_hf_model("Qwen3MoeForCausalLM", str(tmp_path), seed=12)
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path))  # bf16 safetensors, which numpy alone cannot name
    mesh = _mesh()
    bf16 = from_pretrained(str(tmp_path), dtype=jnp.bfloat16, mesh=mesh)
    fp32 = from_pretrained(str(tmp_path), dtype=jnp.float32, mesh=mesh)
    for model, dtype in ((bf16, jnp.bfloat16), (fp32, jnp.float32)):
        for path, array, sharding in _placed_and_expected(model, mesh):
            assert array.sharding == sharding, path
            assert array.dtype == dtype, path
    embed = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(bf16.embed_tokens[...], np.float32), embed)
    np.testing.assert_array_equal(fp32.embed_tokens[...], embed)
    # fp32 params hold the bf16 weights exactly: the same model as transformers' upcast one.
    reference = _hf_logits(hf.float(), _ids())
    assert np.abs(_logits(fp32, _ids()) - reference).max() <= TOL


def test_float32_checkpoint_rounds_to_bfloat16_as_torch_does(tmp_path):
    hf = make_hf_model("LlamaForCausalLM", str(tmp_path), seed=13)
    model = from_pretrained(str(tmp_path), dtype=jnp.bfloat16, mesh=_mesh())
    weight = hf.model.layers[1].mlp.down_proj.weight.detach()
    expected = weight.to(torch.bfloat16).float().numpy().T
    kernel = model.layers[1].mlp.down_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), expected)


def test_no_device_receives_more_than_its_shard(tmp_path, monkeypatch):
    """Host-to-device copies end in XLA's `batched_device_put` (`device_put`, `jnp.asarray`,
    safetensors' flax arrays, `make_array_from_callback`); a spy there sees each copy's target
    sharding and the pieces sent to its devices. A load that put any tensor whole on one device
    first (to shard it afterwards) shows that copy. JAX's C++ dispatch caches a repeated
    `device_put` past Python, so the caches are cleared first: every copy then passes the spy
    (a private function: should JAX rename it, the test fails, it does not pass vacuously)."""
    make_hf_model("Qwen3MoeForCausalLM", str(tmp_path), seed=14)
    mesh = _mesh()
    copies = []
    put = xla_client.batched_device_put

    def spy(aval, sharding, pieces, devices, *args, **kwargs):
        copies.append((tuple(aval.shape), sharding, [np.shape(p) for p in pieces]))
        return put(aval, sharding, pieces, devices, *args, **kwargs)

    jax.clear_caches()
    monkeypatch.setattr(xla_client, "batched_device_put", spy)
    model = from_pretrained(str(tmp_path), mesh=mesh)
    monkeypatch.undo()

    placed = _placed_and_expected(model, mesh)
    assert any(s.shard_shape(x.shape) != x.shape for _, x, s in placed), "nothing was sharded"
    # One copy per param, straight to the sharding it keeps, each device sent its shard only.
    expected = collections.Counter((tuple(x.shape), s) for _, x, s in placed)
    assert collections.Counter((shape, s) for shape, s, _ in copies) == expected
    for shape, sharding, pieces in copies:
        assert pieces == [sharding.shard_shape(shape)] * len(pieces), (shape, sharding)


def test_export_sends_nothing_back_to_a_device(tmp_path, monkeypatch):
    """The mirror of the load: `save_pretrained` gathers each tensor into host memory and
    writes it from there. It used to put each one whole onto the default device again (twice:
    `jnp.asarray`, then a contiguous `jnp.array` copy), which a model larger than one device
    cannot survive. The spy is the load test's: every host-to-device copy passes it."""
    make_hf_model("Qwen3MoeForCausalLM", str(tmp_path / "source"), seed=15)
    model = from_pretrained(str(tmp_path / "source"), mesh=_mesh())
    copies = []
    put = xla_client.batched_device_put

    def spy(aval, sharding, pieces, devices, *args, **kwargs):
        copies.append((tuple(aval.shape), sharding))
        return put(aval, sharding, pieces, devices, *args, **kwargs)

    jax.clear_caches()
    monkeypatch.setattr(xla_client, "batched_device_put", spy)
    save_pretrained(model, str(tmp_path / "export"))
    monkeypatch.undo()
    whole = [(shape, s) for shape, s in copies if len(shape) >= 2]  # a weight, not an index
    assert not whole, whole[:3]
    with (
        safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as exported,
        safe_open(str(tmp_path / "source" / "model.safetensors"), "np") as source,
    ):
        names = sorted(source.keys())
        assert sorted(exported.keys()) == names
        for name in names:
            np.testing.assert_array_equal(exported.get_tensor(name), source.get_tensor(name))
