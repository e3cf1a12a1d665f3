"""Tiny random Hugging Face models, built with `transformers` on CPU, saved to a directory."""

from __future__ import annotations

import torch
import transformers

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def hf_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    kw = dict(TINY, **overrides)
    if arch == "LlamaForCausalLM":
        kw.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        return transformers.LlamaConfig(**kw)
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(**kw)
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(head_dim=16, **kw)
    if arch == "Qwen3MoeForCausalLM":
        moe = dict(
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        return transformers.Qwen3MoeConfig(**{**moe, **kw})
    raise ValueError(arch)


def make_hf_model(arch: str, path: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Builds a tiny random model with non-trivial norms and biases and saves it to `path`."""
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
