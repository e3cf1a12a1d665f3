"""Parity of `from_pretrained` / `save_pretrained` against `transformers` on CPU."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import make_hf_model
from safetensors.numpy import load_file, save_file

from dora_jax.models import SUPPORTED_ARCHITECTURES, from_pretrained, save_pretrained

TOL = 1e-4


def _ids(batch=2, seq=40, vocab=97, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_logits_match_transformers(arch, tmp_path):
    hf = make_hf_model(arch, str(tmp_path))
    ids = _ids()
    ours = np.asarray(from_pretrained(str(tmp_path))(jnp.asarray(ids, jnp.int32)))
    assert ours.shape == (2, 40, 97)
    assert np.abs(ours - _hf_logits(hf, ids)).max() <= TOL


@pytest.mark.parametrize(
    "arch,overrides",
    [
        (
            "Qwen3ForCausalLM",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (
            "LlamaForCausalLM",
            {
                "tie_word_embeddings": True,
                "attention_bias": True,
                "mlp_bias": True,
                "rope_scaling": None,
            },
        ),
    ],
)
def test_config_variants_match_transformers(arch, overrides, tmp_path):
    hf = make_hf_model(arch, str(tmp_path), seed=1, **overrides)
    ids = _ids(seq=100, seed=1)
    ours = np.asarray(from_pretrained(str(tmp_path))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - _hf_logits(hf, ids)).max() <= TOL


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_save_pretrained_round_trips_through_transformers(arch, tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    hf = make_hf_model(arch, src, seed=2)
    save_pretrained(from_pretrained(src), dst)
    reloaded = getattr(transformers, arch).from_pretrained(dst).eval()
    ids = _ids(seed=2)
    assert np.abs(_hf_logits(reloaded, ids) - _hf_logits(hf, ids)).max() <= TOL


def test_sharded_checkpoint_with_index_round_trips(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    hf = make_hf_model("Qwen3ForCausalLM", src, seed=3)
    save_pretrained(from_pretrained(src), dst, max_shard_bytes=8_000)
    shards = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(dst, "model.safetensors.index.json"))
    ids = _ids(seed=3)
    ours = np.asarray(from_pretrained(dst)(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - _hf_logits(hf, ids)).max() <= TOL


def test_bfloat16_load(tmp_path):
    make_hf_model("LlamaForCausalLM", str(tmp_path), seed=4)
    model = from_pretrained(str(tmp_path), dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    fp32 = np.asarray(from_pretrained(str(tmp_path))(jnp.asarray(_ids(), jnp.int32)))
    bf16 = np.asarray(model(jnp.asarray(_ids(), jnp.int32)))
    assert np.abs(bf16 - fp32).max() < 0.1


# --- bad input: every failure names what is wrong --------------------------------------------


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
    make_hf_model("LlamaForCausalLM", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        from_pretrained(str(tmp_path))


def _rewrite_weights(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    make_hf_model("Qwen2ForCausalLM", str(tmp_path))
    _rewrite_weights(str(tmp_path), lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        from_pretrained(str(tmp_path))


def test_wrong_shape_names_tensor_and_file(tmp_path):
    make_hf_model("Qwen3ForCausalLM", str(tmp_path))

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    _rewrite_weights(str(tmp_path), shrink)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*model\.safetensors"
    ):
        from_pretrained(str(tmp_path))


def test_file_listed_in_index_but_missing_is_named(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_hf_model("LlamaForCausalLM", src)
    save_pretrained(from_pretrained(src), dst, max_shard_bytes=8_000)
    victim = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(dst, victim))
    with pytest.raises(FileNotFoundError, match=victim):
        from_pretrained(dst)


def test_no_weights_at_all(tmp_path):
    make_hf_model("LlamaForCausalLM", str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(str(tmp_path))
