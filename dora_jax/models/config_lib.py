"""Architecture hyper-parameters of the decoder family, read from Hugging Face `config.json`.

One frozen dataclass describes Llama, Qwen2, Qwen3 and Qwen3-MoE: they differ only in a few
switches (q/k/v bias, q/k norm, MoE layers), so one decoder implementation serves all four and
a parity bug fixed for one is fixed for all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # q/k norms, one bias switch for q/k/v/o


# Every one of them at least 1: a zero width gave a model that trained at the uniform loss
# without an error, a zero depth an IndexError.
_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of one decoder-only transformer."""

    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict (rope_type: linear | llama3 | yarn | default), or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # The next three default (None) to what the architecture's config.json implies.
    attention_bias: bool | None = None  # bias on q/k/v (Qwen2 always has it)
    attention_out_bias: bool | None = None  # bias on o_proj (Llama's `attention_bias`: both)
    mlp_bias: bool = False
    qk_norm: bool | None = None  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"choose one of {SUPPORTED_ARCHITECTURES}"
            )
        for name in _SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.head_dim % 2:  # rotary embeddings turn the head's halves as pairs
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        qwen2 = self.architecture == "Qwen2ForCausalLM"
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.architecture in _QWEN3)
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", qwen2)
        if self.attention_out_bias is None:
            object.__setattr__(self, "attention_out_bias", False if qwen2 else self.attention_bias)
        self._check_expressible()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )

    def _check_expressible(self) -> None:
        """Refuses switches the architecture's `config.json` cannot state: such a model would
        export as a different one (transformers fills a missing q/k norm with fresh weights)."""
        arch = self.architecture
        qwen3 = arch in _QWEN3
        moe = arch == "Qwen3MoeForCausalLM"
        rules = [
            (self.qk_norm == qwen3, f"qk_norm={qwen3}"),
            (bool(self.num_experts) == moe, "num_experts > 0" if moe else "num_experts=0"),
        ]
        if arch == "Qwen2ForCausalLM":
            rules.append((self.attention_bias, "attention_bias=True"))
            rules.append((not self.attention_out_bias, "attention_out_bias=False"))
        else:  # one switch for the q/k/v and o projections
            rules.append(
                (
                    self.attention_out_bias == self.attention_bias,
                    f"attention_out_bias={self.attention_out_bias} to equal "
                    f"attention_bias={self.attention_bias} (one switch for q/k/v/o)",
                )
            )
        if arch != "LlamaForCausalLM":
            rules.append((not self.mlp_bias, "mlp_bias=False"))
        for holds, needed in rules:
            if not holds:
                raise ValueError(f"architecture {arch} needs {needed}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a parsed Hugging Face `config.json`."""
        architectures = hf.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}"
            )
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architecture {arch!r} is not supported; "
                f"choose one of {SUPPORTED_ARCHITECTURES}"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported (silu)")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_scaling = hf.get("rope_scaling")
        # transformers >= 5 writes rope settings under `rope_parameters`.
        rope_parameters = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            rope_scaling.pop("type", None)
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=_freeze(rope_scaling),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2's config.json has no bias switch (q/k/v always, o never); the others' one
            # switch covers q/k/v/o. The rest of what an architecture implies (its q/k norms,
            # the o bias) is `__post_init__`'s to fill in.
            attention_bias=None if arch == "Qwen2ForCausalLM" else bool(hf.get("attention_bias")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            **(_moe_fields(hf) if arch == "Qwen3MoeForCausalLM" else {}),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content that `transformers` reads back into the same model."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {
                "LlamaForCausalLM": "llama",
                "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe",
            }[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "LlamaForCausalLM":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = self.mlp_bias
        if self.architecture in _QWEN3:
            hf["attention_bias"] = self.attention_bias
        if self.architecture == "Qwen3MoeForCausalLM":
            hf.update(
                num_experts=self.num_experts,
                num_local_experts=self.num_experts,  # the name transformers >= 5 uses
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return hf


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config.json's expert settings; a missing key takes transformers'
    Qwen3MoeConfig default, as transformers itself would (it writes only non-default keys)."""
    return dict(
        num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )


def _freeze(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if d is None:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))
