"""Parity of `from_pretrained` / `save_pretrained` against `transformers` on CPU."""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import make_hf_model
from safetensors.numpy import load_file, save_file

from dora_jax.models import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    from_pretrained,
    save_pretrained,
)

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


def test_saving_again_replaces_the_weights_for_both_readers(tmp_path):
    """A sharded save, then a single-file save into the same directory, then a sharded one
    again: ours and transformers both read the latest weights each time, not stale files."""
    src = {seed: str(tmp_path / f"src{seed}") for seed in (5, 6)}
    hf = {seed: make_hf_model("Qwen3ForCausalLM", path, seed=seed) for seed, path in src.items()}
    dst, ids = str(tmp_path / "dst"), _ids(seed=5)
    for seed, shard_bytes in ((5, 8_000), (6, 4 * 1024**3), (5, 8_000)):
        save_pretrained(from_pretrained(src[seed]), dst, max_shard_bytes=shard_bytes)
        expected = _hf_logits(hf[seed], ids)
        ours = np.asarray(from_pretrained(dst)(jnp.asarray(ids, jnp.int32)))
        theirs = _hf_logits(transformers.Qwen3ForCausalLM.from_pretrained(dst).eval(), ids)
        assert np.abs(ours - expected).max() <= TOL
        assert np.abs(theirs - expected).max() <= TOL


def test_export_with_source_keeps_token_ids_tokenizer_and_generation_config(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_hf_model(
        "LlamaForCausalLM", src, seed=7, bos_token_id=90, eos_token_id=91, pad_token_id=92
    )
    transformers.GenerationConfig(eos_token_id=[91, 93]).save_pretrained(src)
    with open(os.path.join(src, "tokenizer.json"), "w") as f:
        f.write('{"stand-in": "copied byte for byte"}')
    save_pretrained(from_pretrained(src), dst, source=src)
    config = transformers.AutoConfig.from_pretrained(dst)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (90, 91, 92)
    assert transformers.GenerationConfig.from_pretrained(dst).eos_token_id == [91, 93]
    with open(os.path.join(dst, "tokenizer.json")) as f:
        assert f.read() == '{"stand-in": "copied byte for byte"}'
    # Without a source, transformers falls back on its own defaults (Llama: bos 1, eos 2).
    save_pretrained(from_pretrained(src), str(tmp_path / "bare"))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "bare")).eos_token_id != 91


def test_missing_moe_keys_take_transformers_defaults(tmp_path):
    """transformers writes only non-default keys; a config.json without num_experts_per_tok or
    norm_topk_prob means Qwen3MoeConfig's 8 and False."""
    hf = make_hf_model(
        "Qwen3MoeForCausalLM", str(tmp_path), seed=8, num_experts=10,
        num_experts_per_tok=8, norm_topk_prob=False,
    )  # fmt: skip
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key in ("num_experts_per_tok", "norm_topk_prob"):
        config.pop(key, None)
    with open(path, "w") as f:
        json.dump(config, f)
    ids = _ids(seed=8)
    ours = np.asarray(from_pretrained(str(tmp_path))(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - _hf_logits(hf, ids)).max() <= TOL


def test_unsupported_activation_is_refused(tmp_path):
    make_hf_model("LlamaForCausalLM", str(tmp_path), hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"architecture": "Qwen3ForCausalLM", "qk_norm": False}, "qk_norm=True"),
        ({"architecture": "LlamaForCausalLM", "qk_norm": True}, "qk_norm=False"),
        ({"architecture": "Qwen2ForCausalLM", "attention_bias": False}, "attention_bias=True"),
        (
            {"architecture": "Qwen2ForCausalLM", "attention_out_bias": True},
            "attention_out_bias=False",
        ),
        ({"architecture": "Qwen3ForCausalLM", "num_experts": 4}, "num_experts=0"),
        ({"architecture": "Qwen3MoeForCausalLM"}, "num_experts > 0"),
        ({"architecture": "Qwen3ForCausalLM", "mlp_bias": True}, "mlp_bias=False"),
        (
            {
                "architecture": "LlamaForCausalLM",
                "attention_bias": True,
                "attention_out_bias": False,
            },
            "attention_out_bias=False to equal attention_bias=True",
        ),
    ],
)
def test_configs_config_json_cannot_state_are_refused(fields, named):
    """Such a model would export as another one: transformers fills a missing q/k norm with
    fresh weights, and our own reader derives these switches from the architecture."""
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig(**fields)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_an_architecture_alone_gives_a_config_its_config_json_states(arch):
    """Unset switches take the architecture's values, so the config survives config.json."""
    config = ModelConfig(architecture=arch, num_experts=4 if "Moe" in arch else 0)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_float32_master_weights_save_as_the_bfloat16_they_compute_with(tmp_path):
    """A bfloat16 run trains float32 master weights and writes them as bfloat16, the dtype of
    the checkpoint it started from, rounded as torch rounds them."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_hf_model("Qwen3ForCausalLM", src, seed=5)
    masters = from_pretrained(src, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    save_pretrained(masters, dst, dtype=jnp.bfloat16)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(dst, torch_dtype="auto")
    original = transformers.Qwen3ForCausalLM.from_pretrained(src)
    assert reloaded.config.torch_dtype == torch.bfloat16
    for name, weight in original.state_dict().items():
        assert reloaded.state_dict()[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(
            reloaded.state_dict()[name], weight.to(torch.bfloat16), rtol=0, atol=0
        )


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
