"""The generation engine: JetStream's Engine API over a slot KV cache, with behaviour log-probs.

The decode state is a `SlotState`: one row per slot holding that slot's KV cache, position, last
token, sampler settings, stop settings and policy version. A prefill result (`Prefix`) and an
exported slot (`ExportedSlot`) are the same structure with their own number of rows and cache
length, so `insert` and `import_slot` are one scatter and a migrated request carries everything
it needs to continue bit-for-bit (no re-prefill).

Params are passed explicitly as `PolicyParams(state, version)`. Only `state` enters the jitted
functions, so a new policy version never recompiles anything; `version` tags every prefix and
every `ResultTokens`, which is how C1 (one version per trajectory) becomes checkable.

Compilation is bounded: prefill pads prompts to a few length buckets and the prompt count to a
power of two; generate, insert, export and free each compile once per engine, and
`generate_steps` once per step count.

A batched prefill runs the model once per distinct prompt: GRPO samples a group of G responses
to each prompt, so a group admitted together costs one prompt's prefill, not G (vLLM's prefix
caching gives the same for whole prompts). Each row still samples its first token with its own
seed. The model runs on the padded row count divided by a power of four, the smallest such
count that holds the distinct prompts: sharing saves at least 3/4 of the model's rows where it
applies, for few more programs (9 instead of 5 per prefill bucket at 16 slots; padding the
distinct count to any power of two compiled 15).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config_fields_lib import as_integer, is_count
from dora_jax.engine import sampling_lib
from dora_jax.engine.request_lib import FinishReason, Request
from dora_jax.engine.sampling_lib import SamplingParams
from dora_jax.engine.slots_lib import (
    RESULT_COLUMNS,
    DecodeState,
    ExportedSlot,
    PolicyParams,
    Prefix,
    ResultTokens,
    SlotState,
    StepResults,
    policy_version,
)
from dora_jax.models import Functional, KVCache, Transformer, sharding_lib
from dora_jax.runtime import transfer_lib

# The leading columns of `_HostRows.ints`, one per row; the eos ids and the tokens follow.
_LENGTH, _REAL, _SLOT, _VERSION, _TOP_K, _SEED, _MAX_NEW, _MIN_NEW = range(8)
_PROMPT, _PROMPT_LENGTH = 8, 9  # the row's distinct prompt; the length of distinct prompt i
_INT_COLUMNS = 10


class _HostRows(NamedTuple):
    """A batched prefill's host inputs as two arrays. Every host array passed to a jitted call
    is a transfer of its own: as a dozen separate arrays they made an `admit` dispatch cost
    450-470 us on CPU, as these two 300-350 us (measured), and a streaming rollout admits on
    most decode steps.

    `ints` is int32 [rows, 10 + max_eos_ids + bucket]: length, real (1 for a request, 0 for
    padding), target slot, version, top_k, seed (its uint32 bits), max_new_tokens,
    min_new_tokens, the row's prompt (an index into the distinct prompts) and the length of
    distinct prompt i (in row i), then the eos ids (-1 padded), then distinct prompt i's padded
    tokens (in row i; rows past the distinct prompts are unused). `floats` is float32
    [rows, 2]: temperature, top_p. The accessors unpack them inside a jitted program.
    """

    ints: Any
    floats: Any

    def column(self, i: int) -> Any:
        return self.ints[:, i]

    def real(self) -> Any:
        """bool per row: a request (True) or padding."""
        return self.column(_REAL) > 0

    def eos_ids(self, max_eos_ids: int) -> Any:
        return self.ints[:, _INT_COLUMNS : _INT_COLUMNS + max_eos_ids]

    def prompts(self, max_eos_ids: int, distinct: int) -> tuple[Any, Any]:
        """The distinct prompts' padded tokens [distinct, bucket] and lengths [distinct]."""
        return (
            self.ints[:distinct, _INT_COLUMNS + max_eos_ids :],
            self.ints[:distinct, _PROMPT_LENGTH],
        )

    def settings(self, max_eos_ids: int) -> dict[str, Any]:
        """The per-slot sampler and stop columns, as `SlotState` holds them."""
        return dict(
            temperature=self.floats[:, 0],
            top_k=self.column(_TOP_K),
            top_p=self.floats[:, 1],
            seed=jax.lax.bitcast_convert_type(self.column(_SEED), jnp.uint32),
            max_new_tokens=self.column(_MAX_NEW),
            min_new_tokens=self.column(_MIN_NEW),
            eos_ids=self.eos_ids(max_eos_ids),
        )


class _RowSettings(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    min_new_tokens: int
    eos_ids: tuple[int, ...]


def prompt_row_counts(rows: int) -> list[int]:
    """The rows a prefill of `rows` (padded) rows may run the model on: all of them, or, when
    its requests share prompts, `rows` divided by a power of four (the module docstring says
    why), largest first."""
    counts = [rows]
    while counts[-1] % 4 == 0:
        counts.append(counts[-1] // 4)
    return counts


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_buckets(max_prefill_length: int, smallest: int = 8) -> tuple[int, ...]:
    """Powers of two from `smallest` below max_prefill_length, then max_prefill_length."""
    buckets, b = [], smallest
    while b < max_prefill_length:
        buckets.append(b)
        b *= 2
    return (*buckets, max_prefill_length)


def bucket_for(buckets: Sequence[int], length: int) -> int:
    """The smallest prefill bucket that holds `length` tokens."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"prompt length {length} exceeds max_prefill_length")


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


class Engine:
    """JetStream-style generation engine for a `dora_jax.models` decoder.

    Args:
      model: a `dora_jax.models.Transformer`; its params are what `load_params` returns.
      max_concurrent_decodes: number of decode slots.
      max_prefill_length: longest prompt.
      max_decode_length: most tokens one request may generate.
      cache_length: KV positions per slot (vLLM's max_model_len); None: max_prefill_length +
        max_decode_length. A request needs prompt + max_new_tokens - 1 of them; a smaller
        cache suits callers that re-prefill long prompts but whose prompt + response stays
        short (the partial-rollout paradigm), since every decode step attends over all of it.
      mesh: the engine's (fsdp, tp) mesh (`sharding_lib.make_mesh`); None: the first device.
        Params shard by the model's logical-axis rules; the KV cache shards slots over `fsdp`
        and kv heads over `tp` where they divide.
      sampling: default `SamplingParams` for requests that carry none (None: temperature 1).
      eos_ids: default EOS ids for requests that carry none.
      max_eos_ids: room per slot for a request's EOS ids.
      prefill_buckets: prompt-length buckets (sorted; the last must be max_prefill_length).
      cache_dtype: KV-cache dtype; None: the model's compute dtype.
      rules: logical-axis sharding rules (default `sharding_lib.DEFAULT_RULES`).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_concurrent_decodes: int,
        max_prefill_length: int,
        max_decode_length: int,
        cache_length: int | None = None,
        mesh: Mesh | None = None,
        sampling: SamplingParams | None = None,
        eos_ids: Sequence[int] = (),
        max_eos_ids: int = 8,
        prefill_buckets: Sequence[int] | None = None,
        cache_dtype: Any = None,
        rules: Mapping[str, str | None] = sharding_lib.DEFAULT_RULES,
    ):
        for name, value in (
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_prefill_length", max_prefill_length),
            ("max_decode_length", max_decode_length),
            ("max_eos_ids", max_eos_ids),
        ):
            if not is_count(value, 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        self.config = model.config
        self._model = model
        # Decoding never updates the params, so they are held in the dtype the model computes
        # in: a bfloat16 model's decode steps read, and its versions move, half the bytes of the
        # trainer's float32 master weights (and compute exactly as with those, cast at use).
        self.param_dtype = np.dtype(model.dtype)
        self._fn, state = Functional.of(model)
        self._slots = int(max_concurrent_decodes)
        self._max_prefill_length = int(max_prefill_length)
        self._max_decode_length = int(max_decode_length)
        if cache_length is None:
            cache_length = self._max_prefill_length + self._max_decode_length
        if not is_count(cache_length, self._max_prefill_length):
            raise ValueError(
                f"cache_length must be an integer >= max_prefill_length="
                f"{self._max_prefill_length}, got {cache_length!r}"
            )
        self._cache_length = int(cache_length)
        self._mesh = mesh if mesh is not None else sharding_lib.make_mesh(jax.devices()[:1], 1, 1)
        self._rules = dict(rules)
        self._cache_dtype = cache_dtype if cache_dtype is not None else model.dtype
        self.sampling = sampling
        self._max_eos_ids = int(max_eos_ids)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self._check_eos_ids(self.eos_ids, "engine")
        buckets = tuple(prefill_buckets or default_buckets(self._max_prefill_length))
        if list(buckets) != sorted(set(buckets)) or buckets[-1] != self._max_prefill_length:
            raise ValueError(
                f"prefill_buckets must be increasing and end at max_prefill_length="
                f"{self._max_prefill_length}, got {buckets}"
            )
        self.prefill_buckets = buckets

        self._param_shardings = sharding_lib.param_shardings(state, self._mesh, self._rules)
        self._param_treedef = jax.tree.structure(state)
        slots_axis = "fsdp" if "fsdp" in self._mesh.axis_names else None
        self._decode_shardings = self._state_shardings(slots_axis=slots_axis)
        self._row_shardings = self._state_shardings(slots_axis=None)
        replicated = NamedSharding(self._mesh, PartitionSpec())
        self._replicated = replicated
        self._init_jit = jax.jit(self._init_impl, out_shardings=self._decode_shardings)
        # The jitted calls take the params as `PolicyParams.leaves` (a flat tuple flattens in
        # C++) and rebuild the state while tracing.
        # `distinct` (static) is how many rows of prompts the model runs on.
        self._prefill_jit = jax.jit(
            lambda leaves, rows, distinct: self._prefill_impl(
                self._unflatten(leaves), rows, distinct
            ),
            static_argnums=(2,),
            out_shardings=(self._row_shardings, replicated, replicated),
        )
        self._admit_jit = jax.jit(
            lambda leaves, ds, rows, distinct: self._admit_impl(
                self._unflatten(leaves), ds, rows, distinct
            ),
            static_argnums=(3,),
            donate_argnums=(1,),
            out_shardings=(self._decode_shardings, replicated, replicated),
        )
        self._generate_jit = jax.jit(
            lambda leaves, ds: self._generate_impl(self._unflatten(leaves), ds),
            donate_argnums=(1,),
            out_shardings=(self._decode_shardings, replicated, replicated),
        )
        # One program per step count (static): a while loop, so it compiles once per count.
        self._generate_steps_jit = jax.jit(
            lambda leaves, ds, steps: self._generate_steps_impl(self._unflatten(leaves), ds, steps),
            static_argnums=(2,),
            donate_argnums=(1,),
            out_shardings=(self._decode_shardings, replicated, replicated),
        )
        self._insert_jit = jax.jit(
            self._insert_impl, donate_argnums=(0,), out_shardings=self._decode_shardings
        )
        self._export_jit = jax.jit(self._export_impl, out_shardings=self._row_shardings)
        self._free_jit = jax.jit(
            self._free_impl, donate_argnums=(0,), out_shardings=self._decode_shardings
        )

    # ---- JetStream properties -----------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def max_decode_length(self) -> int:
        return self._max_decode_length

    @property
    def cache_length(self) -> int:
        return self._cache_length

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    def get_prefix_destination_sharding(self) -> Prefix:
        """Shardings (a `SlotState` of them) that a prefix or exported slot should have on
        this engine's mesh before `insert` / `import_slot`."""
        return self._row_shardings

    # ---- params ---------------------------------------------------------------------------

    def load_params(self, version: int = 0) -> PolicyParams:
        """The model's current params, sharded onto the engine's mesh, as policy `version`."""
        return self.shard_params(nnx.state(self._model), version=version)

    @property
    def param_shardings(self) -> Any:
        """Shardings (a params state of them) of the engine's params on its mesh: where a new
        policy version should be placed before `shard_params` wraps it."""
        return self._param_shardings

    def shard_params(self, state: Any, version: int) -> PolicyParams:
        """Places a params state (same structure as the model's) on the engine's mesh, in the
        engine's `param_dtype`."""
        return PolicyParams(
            transfer_lib.put(state, self._param_shardings, dtype=self.param_dtype).tree,
            version=int(version),
        )

    # ---- decode state ---------------------------------------------------------------------

    def init_decode_state(self) -> DecodeState:
        """An empty decode state: every slot free."""
        return self._init_jit()

    def active_slots(self, decode_state: DecodeState) -> np.ndarray:
        """bool [max_concurrent_decodes]: which slots hold a request still decoding."""
        return np.asarray(jax.device_get(decode_state.active))

    def free_slot(self, decode_state: DecodeState, slot: int | Sequence[int]) -> DecodeState:
        """Stops the request(s) in `slot` (finish reason ABORTED if still decoding), so the
        slot can be refilled. Freeing an idle slot is a no-op."""
        slots = self._check_slots(slot)
        mask = np.zeros(self._slots, bool)
        mask[slots] = True
        return self._free_jit(decode_state, mask)

    # ---- prefill --------------------------------------------------------------------------

    def prefill(
        self,
        *,
        params: PolicyParams,
        existing_prefix: Prefix | None = None,
        padded_tokens: Any,
        true_length: int | Sequence[int],
        requests: Request | Sequence[Request] | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        """Prefills one prompt ([T] tokens, `true_length` int) or several ([B, T], lengths [B]).

        Returns the prefix (KV cache and the first sampled token, one row per prompt) and the
        first token's `ResultTokens`. `requests` optionally gives each row its sampling, seed
        and limits; without it a row uses the engine defaults with seed 0.
        """
        if existing_prefix is not None:
            raise NotImplementedError("prefill with an existing_prefix is not supported")
        tokens = np.asarray(padded_tokens)
        if tokens.ndim not in (1, 2):
            raise ValueError(f"padded_tokens must be [T] or [B, T], got shape {tokens.shape}")
        rows = tokens[None] if tokens.ndim == 1 else tokens
        lengths = np.broadcast_to(np.asarray(true_length, np.int64), (rows.shape[0],))
        if requests is None:
            requests = [Request(prompt_tokens=()) for _ in range(rows.shape[0])]
        elif isinstance(requests, Request):
            requests = [requests]
        if len(requests) != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} prompts but {len(requests)} requests")
        filled = []
        for row, n, req in zip(rows, lengths, requests, strict=True):
            if not 0 <= n <= row.shape[0]:
                raise ValueError(f"true_length {n} outside the padded length {row.shape[0]}")
            prompt = row[: int(n)]
            if len(req.prompt_tokens) and list(req.prompt_tokens) != prompt.tolist():
                raise ValueError(f"request {req.id!r}: prompt_tokens differ from padded_tokens")
            filled.append(dataclasses.replace(req, prompt_tokens=prompt))
        return self.prefill_requests(params, filled)

    def prefill_requests(
        self, params: PolicyParams, requests: Sequence[Request]
    ) -> tuple[Prefix, ResultTokens]:
        """Prefills several requests in one call (row i is requests[i]).

        All rows are padded to the bucket of the longest prompt and the row count to a power of
        two; rows past len(requests) are padding (valid == 0) that `insert` drops. Requests with
        the same prompt share its prefill.
        """
        version = policy_version(params)
        prefix, data, log_probs = self._prefill_jit(
            params.leaves, *self._host_rows(requests, version, slots=())
        )
        return prefix, ResultTokens(data, log_probs, version=version)

    def admit(
        self,
        params: PolicyParams,
        decode_state: DecodeState,
        requests: Sequence[Request],
        slots: Sequence[int],
    ) -> tuple[DecodeState, ResultTokens]:
        """Prefills `requests` straight into `slots` (requests[i] into slots[i]); consumes
        `decode_state`.

        The same slot state, tokens and log-probs as `prefill_requests` then `insert`, as one
        program with no host round trip between the two: a streaming rollout admits requests
        on most decode steps. A slot still decoding is left as it is and its row comes back
        with `valid` = 0, which the caller must check (reading the busy flags first would cost
        the round trip this saves).
        """
        version = policy_version(params)
        slots = self._check_slots(slots)
        if len(slots) != len(requests):
            raise ValueError(f"{len(requests)} requests for {len(slots)} slots")
        rows, distinct = self._host_rows(requests, version, slots)
        decode_state, data, log_probs = self._admit_jit(params.leaves, decode_state, rows, distinct)
        return decode_state, ResultTokens(data, log_probs, version=version)

    def _host_rows(
        self, requests: Sequence[Request], version: int, slots: Sequence[int]
    ) -> tuple[_HostRows, int]:
        """Host-side inputs of a batched prefill, packed into one int32 and one float32 array
        (`_HostRows`), and how many rows of distinct prompts the model runs on (the module
        docstring says why a power of four below the row count). Prompts are padded to the
        bucket of the longest, the row count to a power of two (padding rows have `real` =
        False and no slot)."""
        if not requests:
            raise ValueError("a prefill needs at least one request")
        prompts, settings = zip(*[self.check_request(r) for r in requests], strict=True)
        bucket = self.bucket_for(max(len(p) for p in prompts))
        rows = _next_power_of_two(len(requests))
        distinct: dict[bytes, int] = {}
        prompt_of = [
            distinct.setdefault(p.astype(np.int32).tobytes(), len(distinct)) for p in prompts
        ]
        prompt_rows = min(c for c in prompt_row_counts(rows) if c >= len(distinct))
        if prompt_rows == rows:  # too many distinct prompts to save 3/4 of the rows
            prompt_of = list(range(len(prompts)))
        eos_end = _INT_COLUMNS + self._max_eos_ids
        ints = np.zeros((rows, eos_end + bucket), np.int32)
        floats = np.zeros((rows, 2), np.float32)
        ints[:, _LENGTH] = ints[:, _PROMPT_LENGTH] = 1
        ints[:, _SLOT] = self._slots  # out of range: the scatter drops the row
        ints[:, _VERSION] = version
        ints[:, _MAX_NEW] = 1
        ints[:, _INT_COLUMNS:eos_end] = -1
        floats[:, 1] = 1.0  # top_p of padding rows
        for i, (p, s) in enumerate(zip(prompts, settings, strict=True)):
            ints[i, _LENGTH] = len(p)
            ints[i, _PROMPT] = prompt = prompt_of[i]
            ints[prompt, _PROMPT_LENGTH] = len(p)
            ints[prompt, eos_end : eos_end + len(p)] = p
            ints[i, _REAL] = 1
            ints[i, _TOP_K] = s.top_k
            ints[i, _SEED] = np.uint32(s.seed).view(np.int32)
            ints[i, _MAX_NEW] = s.max_new_tokens
            ints[i, _MIN_NEW] = s.min_new_tokens
            ints[i, _INT_COLUMNS : _INT_COLUMNS + len(s.eos_ids)] = s.eos_ids
            floats[i] = s.temperature, s.top_p
        ints[: len(slots), _SLOT] = slots
        return _HostRows(ints, floats), prompt_rows

    def bucket_for(self, length: int) -> int:
        return bucket_for(self.prefill_buckets, length)

    # ---- insert / generate ---------------------------------------------------------------

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int | Sequence[int]
    ) -> DecodeState:
        """Installs prefix row i into slot[i] (an int slot takes row 0). Rows past len(slot)
        are not inserted. A slot still decoding is an error: free it first. A prefix made on
        another mesh is copied over first."""
        slots = self._check_slots(slot)
        if len(slots) > prefix.num_rows:
            raise ValueError(f"{len(slots)} slots for a prefix of {prefix.num_rows} rows")
        self._check_shape(prefix, "prefix")
        self._check_free(decode_state, slots)
        return self._insert_rows(decode_state, prefix, slots)

    def generate(
        self, params: PolicyParams, decode_state: DecodeState
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot; consumes (donates) `decode_state`."""
        version = policy_version(params)
        decode_state, data, log_probs = self._generate_jit(params.leaves, decode_state)
        return decode_state, ResultTokens(data, log_probs, version=version)

    def generate_steps(
        self, params: PolicyParams, decode_state: DecodeState, steps: int
    ) -> tuple[DecodeState, StepResults]:
        """`steps` decode steps as one program: the same tokens as `steps` calls of `generate`,
        for one dispatch and one read-back (vLLM's multi-step scheduling). The per-call cost
        is the host's, so on a small model or a busy host it is most of a step's; the price is
        that a finished slot can only be refilled after the last step. Stops early once no slot
        is decoding; consumes (donates) `decode_state`."""
        if not is_count(steps, 1):
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        version = policy_version(params)
        decode_state, data, log_probs = self._generate_steps_jit(params.leaves, decode_state, steps)
        return decode_state, StepResults(data, log_probs, version=version)

    # ---- migration ------------------------------------------------------------------------

    def export_slot(self, decode_state: DecodeState, slot: int) -> ExportedSlot:
        """The full state of `slot` (KV, position, last token, sampler and stop settings,
        version) as a one-row `SlotState`. The slot itself is left as it is; free it once the
        request lives elsewhere."""
        (slot,) = self._check_slots(slot)
        return self._export_jit(decode_state, np.int32(slot))

    def import_slot(
        self, decode_state: DecodeState, slot: int, exported: ExportedSlot
    ) -> DecodeState:
        """Installs a slot exported by an engine of the same model (any mesh) into `slot`;
        decoding continues exactly where it stopped, with no re-prefill."""
        slots = self._check_slots(slot)
        if len(slots) != 1 or exported.num_rows != 1:
            raise ValueError("import_slot takes one slot and one exported row")
        self._check_shape(exported, "exported slot")
        host = jax.device_get((exported.prompt_length, exported.max_new_tokens, exported.positions))
        needed = int(host[0][0]) + int(host[1][0]) - 1
        if needed > self._cache_length:
            raise ValueError(
                f"exported request needs {needed} cache positions; this engine's slots hold "
                f"{self._cache_length}"
            )
        self._check_free(decode_state, slots)
        return self._insert_rows(decode_state, exported, slots)

    # ---- settings -------------------------------------------------------------------------

    def resolve_settings(self, request: Request) -> _RowSettings:
        """The per-slot sampler and stop settings of `request` (defaults filled in, checked)."""
        s = request.sampling if request.sampling is not None else self.sampling
        if not isinstance(s, SamplingParams):
            raise TypeError(f"request {request.id!r}: sampling must be SamplingParams")
        max_new = (
            self._max_decode_length if request.max_new_tokens is None else request.max_new_tokens
        )
        if int(max_new) != max_new or not 1 <= max_new <= self._max_decode_length:
            raise ValueError(
                f"request {request.id!r}: max_new_tokens={max_new} must be in "
                f"[1, max_decode_length={self._max_decode_length}]"
            )
        if int(request.min_new_tokens) != request.min_new_tokens or request.min_new_tokens < 0:
            raise ValueError(f"request {request.id!r}: min_new_tokens must be >= 0")
        min_new = int(max_new) if request.ignore_eos else int(request.min_new_tokens)
        eos = self.eos_ids if request.eos_ids is None else tuple(int(e) for e in request.eos_ids)
        self._check_eos_ids(eos, f"request {request.id!r}")
        if int(request.seed) != request.seed:
            raise ValueError(f"request {request.id!r}: seed must be an integer")
        return _RowSettings(
            float(s.temperature),
            int(s.top_k),
            float(s.top_p),
            int(request.seed) % 2**32,
            int(max_new),
            min_new,
            eos,
        )

    def check_request(self, request: Request) -> tuple[np.ndarray, _RowSettings]:
        """Raises ValueError if `request` cannot run on this engine; returns its prompt and
        settings."""
        prompt = self._check_prompt(request)
        settings = self.resolve_settings(request)
        needed = len(prompt) + settings.max_new_tokens - 1
        if needed > self._cache_length:
            raise ValueError(
                f"request {request.id!r}: prompt of {len(prompt)} tokens + max_new_tokens="
                f"{settings.max_new_tokens} needs {needed} KV positions; cache_length="
                f"{self._cache_length}"
            )
        return prompt, settings

    # ---- host-side checks -----------------------------------------------------------------

    def _check_prompt(self, request: Request) -> np.ndarray:
        prompt = np.asarray(request.prompt_tokens)
        name = f"request {request.id!r}"
        if prompt.ndim != 1:
            raise ValueError(f"{name}: prompt_tokens must be 1-D, got shape {prompt.shape}")
        if prompt.size == 0:
            raise ValueError(f"{name}: empty prompt; a prompt needs at least one token")
        if prompt.size > self._max_prefill_length:
            raise ValueError(
                f"{name}: prompt of {prompt.size} tokens exceeds max_prefill_length="
                f"{self._max_prefill_length}"
            )
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"{name}: prompt_tokens must be integers, got {prompt.dtype}")
        bad = (prompt < 0) | (prompt >= self.config.vocab_size)
        if bad.any():
            raise ValueError(
                f"{name}: token id {int(prompt[bad][0])} at position {int(np.argmax(bad))} is "
                f"outside the vocabulary [0, {self.config.vocab_size})"
            )
        return prompt.astype(np.int32)

    def _check_eos_ids(self, eos: tuple[int, ...], name: str) -> None:
        if len(eos) > self._max_eos_ids:
            raise ValueError(f"{name}: {len(eos)} eos_ids, more than max_eos_ids")
        for e in eos:
            if not 0 <= e < self.config.vocab_size:
                raise ValueError(f"{name}: eos id {e} outside [0, {self.config.vocab_size})")

    def _check_slots(self, slot: int | Sequence[int]) -> list[int]:
        given = [slot] if np.ndim(slot) == 0 else list(slot)
        slots = [as_integer(s) for s in given]
        for s, g in zip(slots, given, strict=True):
            if s is None:
                raise ValueError(f"slot {g!r} is not an integer")
            if not 0 <= s < self._slots:
                raise ValueError(f"slot {s} outside [0, max_concurrent_decodes={self._slots})")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")
        return slots

    def _check_free(self, decode_state: DecodeState, slots: list[int]) -> None:
        active = self.active_slots(decode_state)
        busy = [s for s in slots if active[s]]
        if busy:
            raise ValueError(
                f"slot(s) {busy} still hold a decoding request; free them with "
                "engine.free_slot(decode_state, slot) before inserting"
            )

    def _check_shape(self, rows: SlotState, what: str) -> None:
        c = self.config
        layers = len(rows.cache.k)
        _, heads, length, dim = rows.cache.k[0].shape
        if (layers, heads, dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"{what} was made by a different model "
                f"(cache of {layers} layers x {rows.cache.k[0].shape})"
            )
        if length > self._cache_length:
            raise ValueError(f"{what} cache length {length} exceeds {self._cache_length}")
        if rows.eos_ids.shape[1] != self._max_eos_ids:
            raise ValueError(
                f"{what} has room for {rows.eos_ids.shape[1]} eos ids, not "
                f"this engine's max_eos_ids={self._max_eos_ids}"
            )

    def _insert_rows(self, decode_state: DecodeState, rows: SlotState, slots: list[int]):
        # Rows without a slot go to index max_concurrent_decodes, which the scatter drops.
        index = np.full(rows.num_rows, self._slots, np.int32)
        index[: len(slots)] = slots
        # A cross-mesh copy for a migrated slot or a prefix computed by another engine; rows
        # already in place (this engine's own prefill) skip the per-leaf device_put.
        leaves = zip(jax.tree.leaves(rows), jax.tree.leaves(self._row_shardings), strict=True)
        if not all(isinstance(x, jax.Array) and x.sharding == s for x, s in leaves):
            rows = jax.device_put(rows, self._row_shardings)
        return self._insert_jit(decode_state, rows, index)

    # ---- shardings ------------------------------------------------------------------------

    def _state_shardings(self, slots_axis: str | None) -> SlotState:
        c = self.config
        rules = {**self._rules, "slots": slots_axis}
        rows = self._slots if slots_axis else 1
        spec = sharding_lib.partition_spec(
            (rows, c.num_kv_heads, self._cache_length, c.head_dim),
            ("slots", "kv_heads", None, None),
            self._mesh,
            rules,
        )
        kv = NamedSharding(self._mesh, spec)
        rep = NamedSharding(self._mesh, PartitionSpec())
        fields = {f: rep for f in SlotState._fields if f != "cache"}
        per_layer = (kv,) * c.num_layers
        return SlotState(cache=KVCache(per_layer, per_layer), **fields)

    # ---- jitted implementations -----------------------------------------------------------

    def _init_impl(self) -> SlotState:
        n = self._slots
        zeros = jnp.zeros(n, jnp.int32)
        return SlotState(
            cache=KVCache.zeros(self.config, n, self._cache_length, self._cache_dtype),
            tokens=zeros,
            positions=zeros,
            generated=zeros,
            prompt_length=zeros,
            active=jnp.zeros(n, bool),
            finish_reason=zeros,
            version=zeros,
            temperature=jnp.zeros(n, jnp.float32),
            top_k=zeros,
            top_p=jnp.ones(n, jnp.float32),
            seed=jnp.zeros(n, jnp.uint32),
            max_new_tokens=zeros,
            min_new_tokens=zeros,
            eos_ids=jnp.full((n, self._max_eos_ids), -1, jnp.int32),
        )

    def _unflatten(self, leaves: Sequence[jax.Array]) -> Any:
        return jax.tree.unflatten(self._param_treedef, leaves)

    def _prefill_logits(self, state, tokens, lengths):
        """Runs the prompt through the model into a fresh cache; logits at each last token."""
        rows, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
        cache = KVCache.zeros(self.config, rows, length, self._cache_dtype)
        out = self._fn.forward(state, tokens, positions, cache, logits_at=lengths - 1)
        return out.logits[:, 0], out.cache

    def _prefill_impl(self, state, rows: _HostRows, distinct: int):
        prefix, log_prob = self._prefill_rows(state, rows, distinct)
        return prefix, *_pack_rows(prefix, rows.real(), log_prob)

    def _admit_impl(self, state, ds: SlotState, rows: _HostRows, distinct: int):
        prefix, log_prob = self._prefill_rows(state, rows, distinct)
        real, index = rows.real(), rows.column(_SLOT)
        # A row whose slot is still decoding is dropped (sent to the scatter's out-of-range
        # index) and reported not valid.
        busy = jnp.take(ds.active, index, mode="fill", fill_value=False)
        taken = real & ~busy
        ds = self._insert_impl(ds, prefix, jnp.where(taken, index, self._slots))
        return ds, *_pack_rows(prefix, taken, log_prob)

    def _prefill_rows(self, state, host: _HostRows, distinct: int):
        rows, lengths = host.ints.shape[0], host.column(_LENGTH)
        columns = host.settings(self._max_eos_ids)
        logits, cache = self._prefill_logits(state, *host.prompts(self._max_eos_ids, distinct))
        if distinct < rows:  # rows share prompts: each takes its prompt's logits and KV
            prompt = host.column(_PROMPT)
            logits = logits[prompt]
            cache = jax.tree.map(lambda x: x[prompt], cache)
        zeros = jnp.zeros(rows, jnp.int32)
        keys = sampling_lib.token_keys(columns["seed"], zeros)
        token, log_prob = sampling_lib.sample(
            logits, columns["temperature"], columns["top_k"], columns["top_p"], keys
        )
        generated = jnp.ones(rows, jnp.int32)
        finish = _finish_reason(
            token,
            generated,
            columns["max_new_tokens"],
            columns["min_new_tokens"],
            columns["eos_ids"],
        )
        prefix = SlotState(
            cache=cache,
            tokens=token,
            positions=lengths,
            generated=generated,
            prompt_length=lengths,
            active=host.real() & (finish == FinishReason.NONE),
            finish_reason=finish,
            version=host.column(_VERSION),
            **columns,
        )
        return prefix, log_prob

    def _generate_impl(self, state, ds: SlotState):
        out = self._fn.forward(state, ds.tokens[:, None], ds.positions[:, None], ds.cache)
        keys = sampling_lib.token_keys(ds.seed, ds.generated)
        token, log_prob = sampling_lib.sample(
            out.logits[:, 0], ds.temperature, ds.top_k, ds.top_p, keys
        )
        step = ds.active
        generated = ds.generated + step.astype(jnp.int32)
        finish = jnp.where(
            step,
            _finish_reason(token, generated, ds.max_new_tokens, ds.min_new_tokens, ds.eos_ids),
            ds.finish_reason,
        )
        token = jnp.where(step, token, ds.tokens)
        # Idle slots also wrote a K/V entry at their position; it lies past everything their
        # (finished) request holds, so nothing can ever attend to it.
        new = ds._replace(
            cache=out.cache,
            tokens=token,
            positions=ds.positions + step.astype(jnp.int32),
            generated=generated,
            active=step & (finish == FinishReason.NONE),
            finish_reason=finish,
        )
        log_prob = jnp.where(step, log_prob, 0.0)
        return new, *_pack(token, step, generated, finish, ds.version, log_prob)

    def _generate_steps_impl(self, state, ds: SlotState, steps: int):
        data = jnp.zeros((steps, self._slots, len(RESULT_COLUMNS)), jnp.int32)
        log_probs = jnp.zeros((steps, self._slots, 1), jnp.float32)

        def more(carry):
            step, ds, _, _ = carry
            return (step < steps) & jnp.any(ds.active)

        def decode(carry):
            step, ds, data, log_probs = carry
            ds, tokens, token_log_probs = self._generate_impl(state, ds)
            return step + 1, ds, data.at[step].set(tokens), log_probs.at[step].set(token_log_probs)

        _, ds, data, log_probs = jax.lax.while_loop(more, decode, (0, ds, data, log_probs))
        return ds, data, log_probs

    def _insert_impl(self, ds: SlotState, rows: SlotState, index):
        length = rows.cache.k[0].shape[2]

        def put_cache(dst, src):
            return dst.at[index, :, :length].set(src.astype(dst.dtype), mode="drop")

        put = lambda dst, src: dst.at[index].set(src.astype(dst.dtype), mode="drop")
        fields = {f: put(getattr(ds, f), getattr(rows, f)) for f in SlotState._fields[1:]}
        return SlotState(cache=jax.tree.map(put_cache, ds.cache, rows.cache), **fields)

    def _export_impl(self, ds: SlotState, slot):
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=axis)
        fields = {f: take(getattr(ds, f), 0) for f in SlotState._fields[1:]}
        return SlotState(cache=jax.tree.map(lambda x: take(x, 0), ds.cache), **fields)

    def _free_impl(self, ds: SlotState, mask):
        stopping = ds.active & mask
        return ds._replace(
            active=ds.active & ~mask,
            finish_reason=jnp.where(stopping, FinishReason.ABORTED, ds.finish_reason),
        )


def _finish_reason(token, generated, max_new_tokens, min_new_tokens, eos_ids):
    """FinishReason after sampling `token` as the request's `generated`-th token."""
    is_eos = jnp.any(token[:, None] == eos_ids, axis=-1) & (generated > min_new_tokens)
    return jnp.where(
        is_eos,
        FinishReason.EOS,
        jnp.where(generated >= max_new_tokens, FinishReason.LENGTH, FinishReason.NONE),
    ).astype(jnp.int32)


def _pack_rows(prefix: SlotState, valid, log_prob):
    return _pack(
        prefix.tokens, valid, prefix.generated, prefix.finish_reason, prefix.version, log_prob
    )


def _pack(token, valid, length, finish, version, log_prob):
    data = jnp.stack(
        [token, valid.astype(jnp.int32), length, finish, version.astype(jnp.int32)], axis=-1
    ).astype(jnp.int32)
    return data, log_prob[:, None].astype(jnp.float32)
