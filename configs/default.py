"""The embedded CPU default: a tiny Qwen3-style policy on 8 virtual CPU devices."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.num_cpu_devices = 8

    config.model = ml_collections.ConfigDict()
    config.model.architecture = "Qwen3ForCausalLM"
    config.model.vocab_size = 64
    config.model.hidden_size = 64
    config.model.intermediate_size = 128
    config.model.num_layers = 2
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 16
    config.model.qk_norm = True
    # A Hugging Face model directory to start from instead of a random init.
    config.model.checkpoint = ""
    return config
