"""Tiny model shapes shared by the model, engine and JetStream-adapter tests.

Small enough to compile and run in seconds on 2 CPU cores, yet with grouped-query attention,
q/k norm and (for MOE) top-2 routing over 5 experts, so every code path is exercised.
"""

import dataclasses

from dora_jax.models import ModelConfig

VOCAB = 50
DENSE = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
)
MOE = dataclasses.replace(
    DENSE,
    architecture="Qwen3MoeForCausalLM",
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
