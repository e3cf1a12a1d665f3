"""Generation engine with JetStream's Engine API: slot KV cache, sampling, behaviour log-probs,
and zero-re-prefill slot migration.

Slot-by-slot API (what rollout drives)::

    engine = Engine(model, max_concurrent_decodes=S, max_prefill_length=P,
                    max_decode_length=D, mesh=mesh, sampling=SamplingParams(temperature=1.0),
                    eos_ids=(eos,))
    params = engine.load_params(version=0)          # PolicyParams(state, version) on the mesh
    params = engine.shard_params(new_state, version=v)   # a later policy version, same engine
    ds = engine.init_decode_state()                 # every slot free

    # Prefill one prompt (JetStream signature) or several; the first token is sampled here.
    prefix, first = engine.prefill(params=params, padded_tokens=tokens, true_length=n,
                                   requests=Request(prompt_tokens=(), seed=7))
    prefix, first = engine.prefill_requests(params, [req_a, req_b])  # row i is request i
    ds = engine.insert(prefix, ds, slot)            # int slot, or one slot per prefix row

    ds, result = engine.generate(params, ds)        # one token per slot; donates ds
    r = result.convert_to_numpy().get_result_at_slot(slot)
    r.tokens[0, 0], r.valid[0, 0], r.lengths[0]     # JetStream's SlotData fields, plus
    r.log_probs[0, 0], r.finish_reason[0], r.version[0]   # behaviour log-prob, status, version
    result.version                                  # version of the params that sampled it

    ds = engine.free_slot(ds, slot)                 # abort (e.g. a host-side stop string)
    exported = engine.export_slot(ds, slot)         # KV, position, last token, sampler state
    ds_b = engine_b.import_slot(ds_b, slot_b, exported)   # any mesh; continues bit-for-bit

Semantics:

- `ResultTokens` rows: `valid` is 1 where the slot was decoding before the step; `lengths` is
  tokens generated so far including this one; `finish_reason` (a `FinishReason`) is non-zero
  on the token that ended the request (EOS, LENGTH). A finished slot stops by itself; it can
  be refilled without `free_slot`. Inserting into a slot that is still decoding raises.
- The first token comes from `prefill` (its `ResultTokens`, row i for request i), so a request
  of max_new_tokens=1, or whose first token is EOS, is finished at prefill and its prefix is
  inserted as an idle slot.
- Every token's log-prob is the policy's, log-softmax of the logits over the temperature
  (before top-k and top-p, which only choose what is drawn; greedy rows report the unscaled
  log-softmax): what the trainer computes at the same params (`sampling_lib`). Token i of a
  request uses PRNG key fold_in(key(seed), i): the same tokens in any slot, batch, engine or
  after a migration.
- Each slot carries the `version` of the params that prefilled it (`SlotData.version`); every
  `ResultTokens` carries the version of the params that produced it (`.version`). Keeping them
  equal is the caller's job (C1); the engine never swaps params by itself.
- Stop sequences and stop strings are checked on the host (`StopMatcher`); EOS ids,
  min_new_tokens / ignore_eos and max_new_tokens are checked on the device.
- Bad input (empty prompt, prompt longer than max_prefill_length, token id outside the
  vocabulary, busy or out-of-range slot, bad sampling values) raises ValueError before any
  device work, so the decode state is untouched.

For callers that only want completions: `generate_all(engine, params, requests)` runs
continuous batching to the end and returns one `Completion` per request, in order.

`dora_jax.engine.jetstream_adapter.JetStreamEngine` wraps an `Engine` as a subclass of
`jetstream.engine.engine_api.Engine` for JetStream's own orchestrator (extra `jetstream`).
"""

from dora_jax.engine.engine_lib import Engine
from dora_jax.engine.generate_lib import generate_all
from dora_jax.engine.request_lib import (
    Completion,
    FinishReason,
    Request,
    StopMatcher,
    TextStream,
)
from dora_jax.engine.sampling_lib import SamplingParams
from dora_jax.engine.slots_lib import (
    DecodeState,
    ExportedSlot,
    PolicyParams,
    Prefix,
    ResultTokens,
    SlotData,
    SlotState,
)

__all__ = [
    "Completion",
    "DecodeState",
    "Engine",
    "ExportedSlot",
    "FinishReason",
    "PolicyParams",
    "Prefix",
    "Request",
    "ResultTokens",
    "SamplingParams",
    "SlotData",
    "SlotState",
    "StopMatcher",
    "TextStream",
    "generate_all",
]
