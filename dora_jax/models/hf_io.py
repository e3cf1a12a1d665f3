"""Hugging Face checkpoint import / export (config.json + safetensors).

The mapping between our parameter paths and Hugging Face tensor names is one table
(`_tensor_map`), used in both directions, so import and export cannot drift apart. Every
expected tensor must be found with its exact shape: a partial load raises an error naming the
file and the tensor instead of silently keeping random weights.

Given a mesh, import never puts a whole tensor on one accelerator: each tensor is read, converted
and laid out (transposed, experts stacked) in host memory, then placed straight onto its
sharding, so every device receives only its own shard and a model larger than one chip loads
onto a mesh of them. Export gathers each tensor into host memory and writes it from there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from dora_jax.models import lora_lib, model_lib, sharding_lib
from dora_jax.models.config_lib import ModelConfig

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Where a LoRA policy's directory keeps its adapters alone, in PEFT's format (`save_adapter`).
ADAPTER_DIR = "adapter"
# What a Hugging Face model directory holds beside its weights and config.json, copied on
# export so that the result replaces the directory it came from (tokenizer, chat template,
# generation defaults such as the eos ids a serving stack stops on).
_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_map(config: ModelConfig) -> dict[tuple[Any, ...], tuple[str, str]]:
    """Our param path -> (Hugging Face name or name template, layout kind).

    Kinds: `plain` (same layout), `linear` (torch [out, in] <-> our [in, out]), `experts` (one
    torch Linear per expert, `{e}` in the name, stacked on our leading expert axis).
    """
    out: dict[tuple[Any, ...], tuple[str, str]] = {
        ("embed_tokens",): ("model.embed_tokens.weight", "plain"),
        ("norm", "weight"): ("model.norm.weight", "plain"),
    }
    if not config.tie_word_embeddings:
        out[("lm_head",)] = ("lm_head.weight", "linear")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", ("layers", i)
        out[(*ours, "input_layernorm", "weight")] = (f"{hf}.input_layernorm.weight", "plain")
        out[(*ours, "post_attention_layernorm", "weight")] = (
            f"{hf}.post_attention_layernorm.weight",
            "plain",
        )
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[(*ours, "self_attn", proj, "kernel")] = (f"{hf}.self_attn.{proj}.weight", "linear")
            has_bias = config.attention_out_bias if proj == "o_proj" else config.attention_bias
            if has_bias:
                out[(*ours, "self_attn", proj, "bias")] = (f"{hf}.self_attn.{proj}.bias", "plain")
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[(*ours, "self_attn", norm, "weight")] = (
                    f"{hf}.self_attn.{norm}.weight",
                    "plain",
                )
        if config.is_moe_layer(i):
            out[(*ours, "mlp", "router")] = (f"{hf}.mlp.gate.weight", "linear")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[(*ours, "mlp", proj)] = (f"{hf}.mlp.experts.{{e}}.{proj}.weight", "experts")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[(*ours, "mlp", proj, "kernel")] = (f"{hf}.mlp.{proj}.weight", "linear")
                if config.mlp_bias:
                    out[(*ours, "mlp", proj, "bias")] = (f"{hf}.mlp.{proj}.bias", "plain")
    return out


class _CheckpointReader:
    """Finds each tensor in a directory's weights: `model.safetensors`, or else the shards its
    `model.safetensors.index.json` lists (the order transformers looks in, so that both read
    the same weights from a directory that has both).

    Tensors come back as numpy arrays in host memory: the "flax" framework would put each one
    whole on the default device. numpy knows bfloat16 (and the fp8 types) by name only once
    `ml_dtypes` has registered them, which importing jax (it depends on ml_dtypes) has done.
    """

    def __init__(self, path: str):
        index_path = os.path.join(path, _INDEX)
        single = os.path.join(path, _SINGLE)
        self._handles: dict[str, Any] = {}
        self.weight_map: dict[str, str]
        if os.path.exists(single):
            self._handles[_SINGLE] = safe_open(single, framework="numpy")
            self.weight_map = dict.fromkeys(self._handles[_SINGLE].keys(), _SINGLE)
        elif os.path.exists(index_path):
            with open(index_path) as f:
                self.weight_map = json.load(f)["weight_map"]
            for name in sorted(set(self.weight_map.values())):
                file_path = os.path.join(path, name)
                if not os.path.exists(file_path):
                    raise FileNotFoundError(f"{file_path} is listed in {index_path} but is missing")
                self._handles[name] = safe_open(file_path, framework="numpy")
        else:
            raise FileNotFoundError(f"neither {_SINGLE} nor {_INDEX} in {path}")
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(
                f"tensor {name!r} is missing from the checkpoint (files: {sorted(self._handles)})"
            )
        file = self.weight_map[name]
        tensor = self._handles[file].get_tensor(name)
        if tuple(tensor.shape) != tuple(expected_shape):
            raise ValueError(
                f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected_shape)}"
            )
        self.used.add(name)
        return tensor


def _load_experts(reader: _CheckpointReader, template: str, shape: tuple[int, ...]) -> np.ndarray:
    num_experts, din, dout = shape
    per_expert = template.format(e=0)
    if reader.has(per_expert):
        return np.stack(
            [reader.get(template.format(e=e), (dout, din)).T for e in range(num_experts)]
        )
    # transformers >= 5 keeps experts fused in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    prefix, proj = template.split(".{e}.")
    proj = proj.removesuffix(".weight")
    if proj == "down_proj":
        return np.swapaxes(reader.get(f"{prefix}.down_proj", (num_experts, dout, din)), 1, 2)
    fused = reader.get(f"{prefix}.gate_up_proj", (num_experts, 2 * dout, din))
    half = fused[:, :dout] if proj == "gate_proj" else fused[:, dout:]
    return np.swapaxes(half, 1, 2)


def _place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """`host` on `sharding`'s devices, each given only its own slice of it. The callback is asked
    for the index of each device this process addresses and needs no other process, so the same
    call places onto a mesh that spans processes (each of them loading). Without a sharding, on
    the default device (uncommitted, as `jnp.asarray` leaves it)."""
    if sharding is None:
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def read_config(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist")
    with open(config_path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def from_pretrained(
    path: str,
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Mapping[str, str | None] = sharding_lib.DEFAULT_RULES,
    lora: lora_lib.LoRAConfig | None = None,
    seed: int = 0,
) -> model_lib.Transformer:
    """Loads a Hugging Face model directory into a `Transformer` (compute dtype `dtype`).

    With a `mesh`, every param lands sharded as `sharding_lib.param_shardings` lays it out by
    `rules`, each device receiving only its shard: the trainer's layout, so a model too large
    for one device loads, and nothing has to move again. Without one, on the default device.
    `lora` adds fresh adapters (of `seed`) to the loaded weights.
    """
    config = read_config(path)
    param_dtype = param_dtype or dtype
    kwargs = {"param_dtype": param_dtype, "dtype": dtype, "lora": lora}
    model = model_lib.abstract(config, **kwargs)
    reader = _CheckpointReader(path)
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    shardings = {}
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(sharding_lib.param_shardings(state, mesh, rules)))
    for key, (hf_name, kind) in _tensor_map(config).items():
        variable = flat[key]
        shape = tuple(variable.shape)
        if kind == "plain":
            value = reader.get(hf_name, shape)
        elif kind == "linear":
            value = reader.get(hf_name, shape[::-1]).T
        else:
            value = _load_experts(reader, hf_name, shape)
        host = np.asarray(value, np.dtype(param_dtype))  # ml_dtypes rounds as XLA does
        sharding = shardings[key].get_value() if key in shardings else None
        flat[key] = variable.replace(_place(host, sharding))
    if lora is not None:
        for key, adapter in nnx.to_flat_state(model_lib.fresh_adapters(config, seed, **kwargs)):
            sharding = shardings[key].get_value() if key in shardings else None
            flat[key] = flat[key].replace(_place(np.asarray(adapter[...]), sharding))
    unused = [
        k for k in reader.weight_map if k not in reader.used and not k.endswith(_IGNORED_SUFFIXES)
    ]
    if unused:
        logging.warning(
            "from_pretrained(%s): ignoring %d unused tensors: %s", path, len(unused), unused[:8]
        )
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _export_tensors(model: model_lib.Transformer) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor by its Hugging Face name, adapters merged into their kernels."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    layouts: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "plain": lambda a: a,
        "linear": lambda a: a.T,
    }
    for key, (hf_name, kind) in _tensor_map(model.config).items():
        value = flat[key][...]
        adapter = (*key[:-1], "lora_a")
        if key[-1] == "kernel" and adapter in flat:
            b = flat[(*key[:-1], "lora_b")][...]
            value = lora_lib.merged_kernel(value, flat[adapter][...], b, model.lora.scale)
        if kind == "experts":
            for e in range(value.shape[0]):
                yield hf_name.format(e=e), value[e].T
        else:
            yield hf_name, layouts[kind](value)


def save_pretrained(
    model: model_lib.Transformer,
    path: str,
    *,
    source: str | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    dtype: Any = None,
) -> None:
    """Writes `config.json` and safetensors shards (with an index when more than one) to `path`,
    replacing any weights an earlier save left there (a stale shard set would otherwise be read
    back instead of these).

    `source`, the Hugging Face directory the model was loaded from, makes the result a drop-in
    replacement for it: config.json keeps the source's keys that are not the architecture's
    (bos / eos / pad token ids, ...) and its tokenizer and generation files are copied.
    `dtype` (None: the params' own) is the tensors' dtype on disk: a bfloat16 model trained on
    float32 master weights is written as the bfloat16 it computes with.
    """
    os.makedirs(path, exist_ok=True)
    config: dict[str, Any] = {}
    if source is not None:
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        config.pop("dtype", None)  # transformers >= 5's name for torch_dtype, set below
        for name in _SIDE_FILES:
            if os.path.exists(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
    config.update(model.config.to_hf_dict())
    dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    if dtype is not None:
        dtypes = {str(np.dtype(dtype))}
    config["torch_dtype"] = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    for name in os.listdir(path):
        if name in (_SINGLE, _INDEX) or _SHARD.fullmatch(name):
            os.remove(os.path.join(path, name))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in _export_tensors(model):
        # Gathered into host memory, tensor by tensor, never whole onto one device (the mirror
        # of `from_pretrained`); numpy writes bfloat16 through ml_dtypes, which jax imports.
        array = np.ascontiguousarray(jax.device_get(value))
        if dtype is not None:
            array = array.astype(dtype)
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    with open(os.path.join(path, _INDEX), "w") as f:
        total = sum(int(np.prod(v.shape)) * v.dtype.itemsize for s in shards for v in s.values())
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_adapter(model: model_lib.Transformer, path: str, *, base: str | None = None) -> None:
    """Writes a LoRA model's adapters alone as a PEFT adapter directory (`adapter_config.json`
    and `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` (and vLLM's LoRA
    serving) puts on the base checkpoint `base`. Each adapted module is named in full in
    `target_modules`: PEFT would also match an MoE layer's expert projections by their short
    names, which keep no adapters here. Float32, as the adapters train."""
    if model.lora is None:
        raise ValueError("save_adapter: the model has no LoRA adapters")
    os.makedirs(path, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    tensors, modules = {}, []
    for key in sorted((k for k in flat if k[-1] == "lora_a"), key=str):
        module = ".".join(map(str, ("model", *key[:-1])))
        modules.append(module)
        if model.config.num_experts and ".mlp." in module:
            logging.warning(
                "save_adapter(%s): %s is a dense layer's MLP projection of an MoE model; PEFT "
                "(with transformers 5) may put it on the experts instead: serve the merged "
                "model where it matters",
                path,
                module,
            )
        for ours, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            value = np.asarray(jax.device_get(flat[(*key[:-1], ours)][...]), np.float32)
            # torch's Linear weight of A is [rank, in], of B [out, rank]: ours transposed.
            tensors[f"base_model.model.{module}.{theirs}.weight"] = np.ascontiguousarray(value.T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": model.lora.rank,
        "lora_alpha": model.lora.alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
