"""Flax NNX decoder-only transformer for the Llama / Qwen2 / Qwen3 (dense and MoE) family.

Every parameter carries `logical_axes` metadata; `sharding_lib` maps those names to mesh axes, so
the same module runs unsharded, FSDP or tensor-parallel without code changes.

`forward` is the one entry point. Given a KV cache it writes the new keys/values at their
`positions` and attends over the whole cache with a `key_position <= query_position` mask, so
prefill (many positions) and decode (one position per slot, each slot at its own position) are
the same code path. Entries past a request's current position may hold stale data from padding
or an earlier request in the slot; the mask never lets a query see them, and a decode step
overwrites each position before any query reaches it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.models import lora_lib, rope_lib
from dora_jax.models.config_lib import ModelConfig

_INIT_STD = 0.02


class KVCache(NamedTuple):
    """Keys and values: one [batch, kv_heads, max_len, head_dim] array per layer.

    One array per layer, not one stacked [layers, ...] array: attention then reads a layer's
    keys where they lie, whereas XLA copies a layer sliced out of a stacked cache, whole, at
    every decode step (a 16-slot, 168-position, 2-layer step on CPU: 0.48-0.64 ms stacked,
    0.30-0.38 ms per layer, measured). Head-major, so each (row, kv head) is one contiguous
    [max_len, head_dim] matrix and attention's two products are plain batched matmuls: a decode
    step measured 2x faster on CPU than with [batch, max_len, kv_heads, head_dim].
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: Any) -> KVCache:
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        layers = range(config.num_layers)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in layers),
                   tuple(jnp.zeros(shape, dtype) for _ in layers))  # fmt: skip

    def with_layer(self, layer: int, k: jax.Array, v: jax.Array) -> KVCache:
        return KVCache(_replace_at(self.k, layer, k), _replace_at(self.v, layer, v))


def _replace_at(items: tuple[jax.Array, ...], i: int, item: jax.Array) -> tuple[jax.Array, ...]:
    return (*items[:i], item, *items[i + 1 :])


# What the backward pass keeps of each decoder layer's forward (`forward(remat=...)`): "none"
# keeps every activation; "full" keeps only the layer's input and recomputes the rest, cutting
# activation memory to about one layer's worth plus a residual per layer, for about a third
# more compute; "dots" keeps the matmul outputs and recomputes the cheap element-wise ops
# around them (norms, activations, softmax). Long RL responses need one of the two on
# accelerators: activations grow with batch x sequence x layers, weights do not.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [batch, seq, vocab], float32
    cache: KVCache | None
    # Tokens routed to each expert, [moe_layers, num_experts] float32, each token counted with its
    # `load_weights` (1 without them); empty for dense models.
    expert_load: jax.Array


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any):
    value = jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def _ones(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any):
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def _as_computed(weight: nnx.Param, dtype: Any) -> jax.Array:
    """A weight used in float32 math (norms, the router, the output head), rounded to the
    compute `dtype` first, like every weight a matmul of the model casts. So params stored in
    the compute dtype (a generation engine's copy) compute as the float32 master weights (the
    trainer's) do. `reduce_precision` rather than a round trip through `dtype`: XLA's GPU
    pipeline folds f32 -> bf16 -> f32 conversions away (`SimplifyFPConversions`)."""
    value = weight[...].astype(jnp.float32)
    if jnp.dtype(dtype) == jnp.float32:
        return value
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _zeros(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any, dtype: Any):
        self.weight = _ones((dim,), ("norm",), param_dtype)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * _as_computed(self.weight, self.dtype)).astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the transpose of torch's Linear.weight).

    With `lora`, a low-rank adapter rides beside the kernel (`lora_lib`): its A is drawn from
    the `lora` stream of `rngs`, so adding adapters leaves every base weight of a seed as it was.
    """

    def __init__(
        self,
        rngs: nnx.Rngs,
        din: int,
        dout: int,
        axes: tuple[str, str],
        *,
        bias: bool,
        param_dtype: Any,
        dtype: Any,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        self.kernel = _param(rngs, (din, dout), axes, param_dtype)
        self.bias = _zeros((dout,), axes[1:], param_dtype) if bias else None
        self.dtype = dtype
        self.lora_a = self.lora_b = None
        self.lora_scale = 0.0
        if lora is not None:
            a = lora_lib.init_a(rngs.lora(), din, lora.rank, param_dtype)
            b = jnp.zeros((lora.rank, dout), param_dtype)
            self.lora_a = nnx.data(nnx.LoRAParam(a, logical_axes=(axes[0], None)))
            self.lora_b = nnx.data(nnx.LoRAParam(b, logical_axes=(None, axes[1])))
            self.lora_scale = lora.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = x @ self.kernel[...].astype(self.dtype)
        if self.lora_a is not None:
            low = x @ self.lora_a[...].astype(self.dtype)
            y = y + (low @ self.lora_b[...].astype(self.dtype)) * jnp.asarray(
                self.lora_scale, self.dtype
            )
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _adapter(lora: lora_lib.LoRAConfig | None, projection: str) -> lora_lib.LoRAConfig | None:
    return lora if lora is not None and projection in lora.targets else None


class Attention(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        rngs: nnx.Rngs,
        param_dtype: Any,
        dtype: Any,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        c = config
        h, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def linear(name: str, din: int, dout: int, axes: tuple[str, str], bias: bool) -> Linear:
            return Linear(
                rngs, din, dout, axes, bias=bias, param_dtype=param_dtype, dtype=dtype,
                lora=_adapter(lora, name),
            )  # fmt: skip

        self.q_proj = linear("q_proj", h, q_dim, ("embed", "q_heads"), c.attention_bias)
        self.k_proj = linear("k_proj", h, kv_dim, ("embed", "kv_heads"), c.attention_bias)
        self.v_proj = linear("v_proj", h, kv_dim, ("embed", "kv_heads"), c.attention_bias)
        self.o_proj = linear("o_proj", q_dim, h, ("q_heads", "embed"), c.attention_out_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, param_dtype, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, param_dtype, dtype) if c.qk_norm else None
        inv_freq, self.attention_factor = rope_lib.inverse_frequencies(
            c.head_dim, c.rope_theta, c.rope_scaling_dict, c.max_position_embeddings
        )
        # A tuple keeps the frequencies static (nnx would treat an array as model state).
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.config = c

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache | None,
        layer: int,
    ) -> tuple[jax.Array, KVCache | None]:
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_lib.apply_rotary(q, positions, self.inv_freq, self.attention_factor)
        k = rope_lib.apply_rotary(k, positions, self.inv_freq, self.attention_factor)

        if cache is None:
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            key_positions = positions
        else:
            rows = jnp.arange(b)[:, None]
            # Scattered into the layer's cache array, so a donated cache is updated in place.
            # Positions past the cache end are dropped by the scatter (JAX's default).
            keys = cache.k[layer].at[rows, :, positions].set(k.astype(cache.k[layer].dtype))
            values = cache.v[layer].at[rows, :, positions].set(v.astype(cache.v[layer].dtype))
            cache = cache.with_layer(layer, keys, values)
            key_positions = jnp.broadcast_to(jnp.arange(keys.shape[2]), (b, keys.shape[2]))

        groups = c.num_heads // c.num_kv_heads
        # Query heads of one kv head, [b, kv_heads, groups * t, d]; head h = kv * groups + g.
        q = q.reshape(b, t, c.num_kv_heads, groups, c.head_dim).transpose(0, 2, 3, 1, 4)
        q = q.reshape(b, c.num_kv_heads, groups * t, c.head_dim)
        scores = jnp.einsum(
            "bkqd,bksd->bkqs", q.astype(jnp.float32), keys.astype(jnp.float32)
        ) / jnp.sqrt(jnp.float32(c.head_dim))
        scores = scores.reshape(b, c.num_kv_heads, groups, t, -1)
        visible = key_positions[:, None, :] <= positions[:, :, None]  # [b, t, s]
        scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).reshape(b, c.num_kv_heads, groups * t, -1)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, values.astype(jnp.float32))
        out = out.reshape(b, c.num_kv_heads, groups, t, c.head_dim).transpose(0, 3, 1, 2, 4)
        out = out.reshape(b, t, c.num_heads * c.head_dim).astype(x.dtype)
        return self.o_proj(out), cache


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        c: ModelConfig,
        inner: int,
        rngs: nnx.Rngs,
        param_dtype: Any,
        dtype: Any,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        kw = dict(bias=c.mlp_bias, param_dtype=param_dtype, dtype=dtype)
        h = c.hidden_size
        up = ("embed", "mlp")
        self.gate_proj = Linear(rngs, h, inner, up, lora=_adapter(lora, "gate_proj"), **kw)
        self.up_proj = Linear(rngs, h, inner, up, lora=_adapter(lora, "up_proj"), **kw)
        self.down_proj = Linear(
            rngs, inner, h, ("mlp", "embed"), lora=_adapter(lora, "down_proj"), **kw
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nnx.Module):
    """Qwen3-MoE feed-forward: softmax router, top-k experts, optional top-k renormalisation.

    Tokens are sorted by expert and run through `jax.lax.ragged_dot`, so compute grows with k,
    not with the number of experts.
    """

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs, param_dtype: Any, dtype: Any):
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.router = _param(rngs, (h, e), ("embed", None), param_dtype)
        self.gate_proj = _param(rngs, (e, h, i), ("expert", "embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (e, h, i), ("expert", "embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (e, i, h), ("expert", "mlp", "embed"), param_dtype)
        self.config = c
        self.dtype = dtype

    def __call__(
        self, x: jax.Array, load_weights: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """The layer's output and its expert load (routings per expert, `load_weights` [...]
        the weight of each token in it)."""
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1]).astype(self.dtype)
        router_logits = tokens.astype(jnp.float32) @ _as_computed(self.router, self.dtype)
        gates = jax.nn.softmax(router_logits, axis=-1)
        weights, experts = jax.lax.top_k(gates, c.num_experts_per_tok)  # [n, k]
        if c.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        token_of = order // c.num_experts_per_tok
        group_sizes = jnp.bincount(flat_experts, length=c.num_experts).astype(jnp.int32)
        sorted_x = tokens[token_of]
        w = lambda p: p[...].astype(self.dtype)
        hidden = jax.nn.silu(jax.lax.ragged_dot(sorted_x, w(self.gate_proj), group_sizes))
        hidden = hidden * jax.lax.ragged_dot(sorted_x, w(self.up_proj), group_sizes)
        expert_out = jax.lax.ragged_dot(hidden, w(self.down_proj), group_sizes)
        sorted_weights = weights.reshape(-1)[order].astype(jnp.float32)
        combined = (
            jnp.zeros(tokens.shape, jnp.float32)
            .at[token_of]
            .add(expert_out.astype(jnp.float32) * sorted_weights[:, None])
        )
        if load_weights is None:
            load = group_sizes.astype(jnp.float32)
        else:
            per_routing = jnp.repeat(load_weights.reshape(-1), c.num_experts_per_tok)
            load = jnp.bincount(
                flat_experts, weights=per_routing.astype(jnp.float32), length=c.num_experts
            )
        return combined.astype(x.dtype).reshape(shape), load


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        c: ModelConfig,
        layer: int,
        rngs: nnx.Rngs,
        param_dtype: Any,
        dtype: Any,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype, dtype)
        self.self_attn = Attention(c, rngs, param_dtype, dtype, lora)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype, dtype)
        if c.is_moe_layer(layer):
            self.mlp = MoE(c, rngs, param_dtype, dtype)
        else:
            self.mlp = MLP(c, c.intermediate_size, rngs, param_dtype, dtype, lora)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache | None,
        layer: int,
        load_weights: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None, jax.Array | None]:
        attn_out, cache = self.self_attn(self.input_layernorm(x), positions, cache, layer)
        x = x + attn_out
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            ff, load = self.mlp(h, load_weights)
        else:
            ff, load = self.mlp(h), None
        return x + ff, cache, load


class Transformer(nnx.Module):
    """Decoder-only causal language model; `model(input_ids)` gives full-sequence logits.

    `lora` adds low-rank adapters to its projections (`lora_lib`); `lora` is None for none."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
        dtype: Any = jnp.float32,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        c = config
        mlp_only = lora is not None and set(lora.targets) <= {"gate_proj", "up_proj", "down_proj"}
        if mlp_only and all(c.is_moe_layer(i) for i in range(c.num_layers)):
            raise ValueError(
                f"LoRA targets {list(lora.targets)} are MLP projections, and every layer of "
                "this model is MoE, whose experts keep no adapters: LoRA would train nothing"
            )
        self.config = c
        self.dtype = dtype
        self.lora = lora
        self.embed_tokens = _param(
            rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), param_dtype
        )
        self.layers = nnx.List(
            [DecoderLayer(c, i, rngs, param_dtype, dtype, lora) for i in range(c.num_layers)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype, dtype)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), param_dtype)
        )

    def __call__(self, input_ids: jax.Array, remat: str = "none") -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        return self.forward(input_ids, positions, remat=remat).logits

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        logits_at: jax.Array | None = None,
        remat: str = "none",
        load_weights: jax.Array | None = None,
    ) -> ForwardOutput:
        """Runs `tokens` [batch, seq] at `positions` [batch, seq], reading/writing `cache`.

        `logits_at` [batch] picks one sequence index per row to apply the output head at
        (logits [batch, 1, vocab]): a prefill needs only the last prompt token's logits, and
        [batch, seq, vocab] in float32 is gigabytes at real vocabulary sizes. `remat` names a
        `REMAT_POLICIES` entry for the layers of a forward that is differentiated (no cache).
        `load_weights` [batch, seq] weighs each token in `expert_load` (0 for padding).
        """
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not one of {sorted(REMAT_POLICIES)}")
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)
        loads = []
        for i, layer in enumerate(self.layers):
            if remat == "none" or cache is not None:
                x, cache, load = layer(x, positions, cache, i, load_weights)
            else:
                run = nnx.remat(
                    _layer_without_cache, policy=REMAT_POLICIES[remat], static_argnums=3
                )
                x, load = run(layer, x, positions, i, load_weights)
            if load is not None:
                loads.append(load)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        x = self.norm(x).astype(jnp.float32)
        if self.lm_head is None:
            head = _as_computed(self.embed_tokens, self.dtype).T
        else:
            head = _as_computed(self.lm_head, self.dtype)
        logits = x @ head
        expert_load = jnp.stack(loads) if loads else jnp.zeros((0, 0), jnp.float32)
        return ForwardOutput(logits, cache, expert_load)


def _layer_without_cache(
    layer: DecoderLayer,
    x: jax.Array,
    positions: jax.Array,
    index: int,
    load_weights: jax.Array | None,
) -> tuple[jax.Array, jax.Array | None]:
    out, _, load = layer(x, positions, None, index, load_weights)
    return out, load


# The adapters' stream: the default stream's draw number _LORA_STREAM, one no model reaches.
_LORA_STREAM = 0x4C6F5241


def _rngs(seed: int) -> nnx.Rngs:
    # Adapters draw from a stream of their own: the base weights of a seed are the same with
    # and without them.
    return nnx.Rngs(seed, lora=jax.random.fold_in(jax.random.key(seed), _LORA_STREAM))


def create(config: ModelConfig, seed: int = 0, **kwargs: Any) -> Transformer:
    """A randomly initialised model (normal(0, 0.02) weights, unit norms; adapters as
    `lora_lib` initialises them)."""
    return Transformer(config, rngs=_rngs(seed), **kwargs)


def abstract(config: ModelConfig, **kwargs: Any) -> Transformer:
    """The model's structure with shape-only leaves; `nnx.update` fills it without a random init."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=_rngs(0), **kwargs))


def fresh_adapters(config: ModelConfig, seed: int, **kwargs: Any) -> nnx.State:
    """The adapters `create(config, seed, **kwargs)` would give, alone: the base weights' random
    init is dead code in this jitted function, so none is computed or held."""
    return jax.jit(lambda: nnx.state(create(config, seed, **kwargs), nnx.LoRAParam))()


@dataclasses.dataclass(frozen=True)
class Functional:
    """A model split into a static graph and a params pytree, for jitted pure functions.

    Params are passed explicitly, so one compiled function serves every policy version.
    """

    graphdef: Any

    # A Functional is a static argument of the trainer's jitted steps, hashed on every call;
    # hashing a graph walks all of its nodes, so the hash is computed once.
    @functools.cached_property
    def _hash(self) -> int:
        return hash(self.graphdef)

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, model: Transformer) -> tuple[Functional, Any]:
        graphdef, params = nnx.split(model)
        return cls(graphdef), params

    def forward(
        self,
        params: Any,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        logits_at: jax.Array | None = None,
        remat: str = "none",
        load_weights: jax.Array | None = None,
    ) -> ForwardOutput:
        model = nnx.merge(self.graphdef, params)
        return model.forward(
            tokens, positions, cache, logits_at, remat=remat, load_weights=load_weights
        )

    def logits(self, params: Any, input_ids: jax.Array, remat: str = "none") -> jax.Array:
        return nnx.merge(self.graphdef, params)(input_ids, remat)
