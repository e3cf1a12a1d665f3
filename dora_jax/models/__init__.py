"""Policy models: the decoder family, its LoRA adapters, its sharding rules and Hugging Face
checkpoint I/O."""

from dora_jax.models.config_lib import SUPPORTED_ARCHITECTURES, ModelConfig
from dora_jax.models.hf_io import from_pretrained, read_config, save_adapter, save_pretrained
from dora_jax.models.lora_lib import LoRAConfig
from dora_jax.models.model_lib import (
    REMAT_POLICIES,
    ForwardOutput,
    Functional,
    KVCache,
    Transformer,
    create,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "REMAT_POLICIES",
    "ForwardOutput",
    "Functional",
    "KVCache",
    "LoRAConfig",
    "ModelConfig",
    "Transformer",
    "create",
    "from_pretrained",
    "read_config",
    "save_adapter",
    "save_pretrained",
]
