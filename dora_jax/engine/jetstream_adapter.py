"""`Engine` as a real `jetstream.engine.engine_api.Engine`, for JetStream's own orchestrator.

Needs the `jetstream` extra (google-jetstream 0.2.2). Differences from the native engine that
JetStream 0.2.2's orchestrator forces:

- Its `prefill` returns only the prefix (the orchestrator hands the whole return value to
  `insert`), and its generate thread emits tokens only from `generate`. So the first token,
  sampled at prefill, would be lost; the adapter's `generate` therefore emits each slot's
  token one step late: a step returns the token sampled by the previous step (or by prefill),
  with `valid` set while the slot still has a token to emit. The token stream is unchanged.
- Its detokenize thread decides when a request is done (its max_tokens, the tokenizer's stop
  tokens) and reuses the slot, so `insert` overwrites whatever the slot holds.
- Its decode state is opaque to it; here it is `(SlotState, pending)`.

Requests come as token ids (client-side tokenization) or as text when `TokenIdTokenizer` is
given an `encode` callable. Each prefill gets the next seed of a counter, so repeated prompts
sample differently under a non-greedy engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# google-jetstream 0.2.2 (its last release; the project is archived) calls `jax.tree_map`,
# which current JAX removed: without this alias its orchestrator threads raise on the first
# request and JetThread SIGKILLs the process. Add the alias only where it is missing.
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map

from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

from dora_jax.engine.engine_lib import Engine  # noqa: E402
from dora_jax.engine.request_lib import Request  # noqa: E402
from dora_jax.engine.slots_lib import PolicyParams, Prefix, SlotState  # noqa: E402


class AdapterDecodeState(NamedTuple):
    slots: SlotState
    pending: jax.Array  # bool [slots]: the slot's last sampled token has not been emitted yet


class TokenIdTokenizer(tokenizer_api.Tokenizer):
    """A JetStream tokenizer over plain token ids.

    `encode` (text -> ids) is needed only for text requests; `decode` (ids -> text) only for
    server-side detokenization, which otherwise shows ids as text.
    """

    def __init__(
        self,
        *,
        bos_id: int,
        eos_ids: Sequence[int],
        pad_id: int = 0,
        encode: Callable[[str], Sequence[int]] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        self._bos_id, self._pad_id = int(bos_id), int(pad_id)
        self._eos_ids = tuple(int(e) for e in eos_ids)
        self._encode, self._decode = encode, decode

    def encode(self, s: str, **kwargs: Any) -> tuple[np.ndarray, int]:
        if self._encode is None:
            raise NotImplementedError("text requests need TokenIdTokenizer(encode=...)")
        return token_utils.pad_tokens(
            np.asarray(self._encode(s), np.int32),
            self.bos_id,
            self.pad_id,
            is_bos=kwargs.pop("is_bos", True),
            prefill_lengths=kwargs.pop("prefill_lengths", None),
            max_prefill_length=kwargs.pop("max_prefill_length", None),
            jax_padding=kwargs.pop("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        if self._decode is None:
            return " ".join(str(t) for t in token_ids)
        return self._decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_ids[0] if self._eos_ids else -1

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def stop_tokens(self) -> set[int]:
        # The default adds pad_id, which is an ordinary token for our models.
        return set(self._eos_ids)


class JetStreamEngine(engine_api.Engine):
    """Wraps a `dora_jax.engine.Engine` for `jetstream.core.orchestrator.Driver`.

    Its `max_prefill_length` must be one of JetStream's padding buckets (16, 32, 64, ...):
    JetStream's `pad_tokens` looks it up in that list.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        tokenizer: TokenIdTokenizer | None = None,
        bos_id: int = 1,
        version: int = 0,
        seed: int = 0,
    ):
        self.engine = engine
        self._tokenizer = tokenizer or TokenIdTokenizer(bos_id=bos_id, eos_ids=engine.eos_ids)
        self._version = version
        self._seeds = itertools.count(seed)
        decode = engine._decode_shardings
        rep = engine._replicated
        self._step_jit = jax.jit(
            self._step_impl,
            donate_argnums=(1,),
            out_shardings=(AdapterDecodeState(decode, rep), rep),
        )

    # ---- the Engine API -------------------------------------------------------------------

    def load_params(self, *args: Any, **kwargs: Any) -> PolicyParams:
        kwargs.setdefault("version", self._version)
        return self.engine.load_params(*args, **kwargs)

    def prefill(
        self,
        *,
        params: PolicyParams,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
    ) -> Prefix:
        prefix, _ = self.engine.prefill(
            params=params,
            existing_prefix=existing_prefix,
            padded_tokens=padded_tokens,
            true_length=true_length,
            requests=Request(prompt_tokens=(), seed=next(self._seeds)),
        )
        return prefix

    def insert(
        self, prefix: Prefix, decode_state: AdapterDecodeState, slot: int
    ) -> AdapterDecodeState:
        slots = self.engine._insert_rows(decode_state.slots, prefix, [int(slot)])
        return AdapterDecodeState(slots, decode_state.pending.at[slot].set(True))

    def generate(
        self, params: PolicyParams, decode_state: AdapterDecodeState
    ) -> tuple[AdapterDecodeState, engine_api.ResultTokens]:
        if not isinstance(params, PolicyParams):
            raise TypeError("params must be PolicyParams (see JetStreamEngine.load_params)")
        decode_state, data = self._step_jit(params.leaves, decode_state)
        result = engine_api.ResultTokens(
            data=data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
        )
        return decode_state, result

    def init_decode_state(self, *args: Any, **kwargs: Any) -> AdapterDecodeState:
        pending = jax.device_put(
            jnp.zeros(self.engine.max_concurrent_decodes, bool), self.engine._replicated
        )
        return AdapterDecodeState(self.engine.init_decode_state(), pending)

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="dora_jax:token-ids", extra_ids=0)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenIdTokenizer:
        del metadata
        return self._tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    # ---- implementation -------------------------------------------------------------------

    def _step_impl(self, leaves: Any, decode_state: AdapterDecodeState):
        # Params come as `PolicyParams.leaves`, as in the engine's own jitted calls.
        ds, pending = decode_state
        emitted = jnp.stack([ds.tokens, pending.astype(jnp.int32), ds.generated], axis=-1)
        new_ds, _, _ = self.engine._generate_impl(self.engine._unflatten(leaves), ds)
        # A slot that decoded this step has a fresh token to emit next step.
        return AdapterDecodeState(new_ds, ds.active), emitted.astype(jnp.int32)
