"""LoRA adapters: against `transformers` with the adapters folded into its weights in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import make_hf_model

from dora_jax.models import ModelConfig, create, from_pretrained, save_adapter, save_pretrained
from dora_jax.models.lora_lib import TARGETS, LoRAConfig

TOL = 1e-4


def _ids(batch=2, seq=24, vocab=97):
    return np.random.RandomState(1).randint(0, vocab, (batch, seq))


def _flat(model) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model))}


def _randomise_b(model, seed=0):
    """Non-zero B everywhere (a fresh adapter's B is zero: it would test nothing)."""
    rng = np.random.RandomState(seed)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    for key, v in flat.items():
        if key[-1] == "lora_b":
            flat[key] = v.replace(jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype))
    nnx.update(model, nnx.from_flat_state(flat))


def test_adapters_keep_a_seeds_base_weights_and_start_as_the_base_model():
    config = ModelConfig(vocab_size=50)
    plain, adapted = create(config, 7), create(config, 7, lora=LoRAConfig(rank=4))
    base, both = _flat(plain), _flat(adapted)
    assert all(np.array_equal(base[k], both[k]) for k in base)
    adapters = {k: v for k, v in both.items() if k not in base}
    # q/k/v/o and gate/up/down in both layers, an A and a B each.
    assert len(adapters) == 2 * 7 * 2
    assert all(not v.any() for k, v in adapters.items() if k[-1] == "lora_b")
    assert all(v.std() > 0 for k, v in adapters.items() if k[-1] == "lora_a")
    ids = jnp.asarray(_ids(vocab=50))
    np.testing.assert_array_equal(np.asarray(plain(ids)), np.asarray(adapted(ids)))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"])
def test_adapted_forward_equals_transformers_with_the_adapters_merged_in_numpy(arch, tmp_path):
    lora = LoRAConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    make_hf_model(arch, str(tmp_path))
    ours = from_pretrained(str(tmp_path), lora=lora)
    _randomise_b(ours)
    flat = _flat(ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    modules = dict(hf.named_modules())
    merged = 0
    for key, a in flat.items():
        if key[-1] != "lora_a":
            continue
        layer, block, proj = key[1], key[2], key[3]
        delta = lora.scale * a @ flat[(*key[:-1], "lora_b")]  # [in, out]
        weight = modules[f"model.layers.{layer}.{block}.{proj}"].weight
        with torch.no_grad():
            weight += torch.from_numpy(delta.T.copy())
        merged += 1
    # MoE layers' experts keep no adapters: the Qwen3-MoE fixture's one dense layer has down_proj.
    assert merged == (7 if arch == "Qwen3MoeForCausalLM" else 8)
    ids = _ids()
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - want).max() <= TOL


def test_save_pretrained_writes_the_merged_model(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    make_hf_model("Qwen2ForCausalLM", str(source))
    adapted = from_pretrained(str(source), lora=LoRAConfig(rank=2), seed=3)
    _randomise_b(adapted, seed=1)
    save_pretrained(adapted, str(out), source=str(source))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = _ids()
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(adapted(jnp.asarray(ids, jnp.int32))) - want).max() <= TOL
    # The file is a plain model: no adapter tensor in it, and it reads back without LoRA.
    reread = from_pretrained(str(out))
    assert not nnx.state(reread, nnx.LoRAParam)
    np.testing.assert_allclose(
        np.asarray(reread(jnp.asarray(ids, jnp.int32))), want, atol=TOL, rtol=0
    )


@pytest.mark.parametrize(
    "arch,targets",
    [("Qwen3ForCausalLM", ("q_proj", "v_proj", "down_proj")), ("LlamaForCausalLM", TARGETS),
     ("Qwen3MoeForCausalLM", ("q_proj", "k_proj", "v_proj", "o_proj"))],
)  # fmt: skip
def test_a_saved_adapter_loads_in_peft_onto_its_base_as_the_adapted_model(arch, targets, tmp_path):
    """PEFT as the reference. (For MoE models PEFT with transformers 5 re-targets MLP names onto
    the fused experts, so an MoE model's adapter is tested on attention.)"""
    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    make_hf_model(arch, base)
    lora = LoRAConfig(rank=3, alpha=6.0, targets=targets)
    ours = from_pretrained(base, lora=lora)
    _randomise_b(ours)
    save_adapter(ours, adapter, base=base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    adapted = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = _ids()
    with torch.no_grad():
        want = adapted(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours(jnp.asarray(ids, jnp.int32))) - want).max() <= TOL
    with pytest.raises(ValueError, match="no LoRA"):
        save_adapter(from_pretrained(base), adapter)


def test_loaded_adapters_are_those_a_random_init_of_the_seed_gives(tmp_path):
    make_hf_model("Qwen3ForCausalLM", str(tmp_path))
    lora = LoRAConfig(rank=2)
    loaded = from_pretrained(str(tmp_path), lora=lora, seed=5)
    fresh = create(loaded.config, 5, lora=lora)
    want = {k: v for k, v in _flat(fresh).items() if k[-1] in ("lora_a", "lora_b")}
    got = _flat(loaded)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
    assert jax.tree.structure(nnx.state(loaded)) == jax.tree.structure(nnx.state(fresh))


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2, "targets": ("lm_head",)}, "targets"),
        ({"rank": 2, "targets": ()}, "targets"),
    ],  # fmt: skip
)
def test_bad_lora_configs_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=named):
        LoRAConfig(**kwargs)


def test_adapters_that_would_train_nothing_are_refused():
    """Every layer MoE and only MLP projections targeted: experts keep no adapters, and the
    trainer would fall back to full fine-tuning without a word."""
    moe = ModelConfig(architecture="Qwen3MoeForCausalLM", num_experts=4, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="LoRA would train nothing"):
        create(moe, lora=LoRAConfig(rank=2, targets=("gate_proj", "up_proj")))
    adapted = create(moe, lora=LoRAConfig(rank=2, targets=["v_proj", "down_proj"]))
    assert len(nnx.state(adapted, nnx.LoRAParam)["layers"][0]["self_attn"]) == 1
    hash(nnx.graphdef(adapted))  # targets given as a list still hash, as a static jit argument
