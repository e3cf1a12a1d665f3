"""`generate_all`: continuous batching to completion, for callers that only want completions
(held-out evaluation, warm-up checks) rather than slot-level control."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from dora_jax.engine.engine_lib import Engine
from dora_jax.engine.request_lib import Completion, FinishReason, Request, StopMatcher, TextStream
from dora_jax.engine.slots_lib import PolicyParams, policy_version


def generate_all(
    engine: Engine,
    params: PolicyParams,
    requests: Sequence[Request],
    *,
    text_stream: Callable[[], TextStream] | None = None,
) -> list[Completion]:
    """Runs `requests` to completion with continuous batching; completions in request order.

    Free slots are refilled (prompts of one length bucket prefilled together) while the other
    slots keep decoding. Every request is checked before any work starts. `text_stream` (the
    tokenizer's) is needed for requests with stop strings.
    """
    version = policy_version(params)
    for r in requests:
        engine.check_request(r)
        if r.stop_strings and text_stream is None:
            raise ValueError(f"request {r.id!r} has stop_strings but no text_stream")
    stops = [
        StopMatcher(r.stop_sequences, r.stop_strings, r.min_new_tokens, text_stream)
        for r in requests
    ]
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    results: list[Completion | None] = [None] * len(requests)
    pending = collections.deque(range(len(requests)))
    owner: list[int | None] = [None] * engine.max_concurrent_decodes
    decode_state = engine.init_decode_state()

    def take(i: int, token: int, logprob: float, finish: int) -> bool:
        """Records one token of request i; True when the request is done."""
        tokens[i].append(token)
        logprobs[i].append(logprob)
        reason = FinishReason(finish)
        # A stop rule completed on the last token allowed is why the request ended: "stop".
        if reason in (FinishReason.NONE, FinishReason.LENGTH) and stops[i].step(token):
            reason = FinishReason.STOP
        if reason == FinishReason.NONE:
            return False
        results[i] = Completion(
            id=requests[i].id,
            prompt_tokens=np.asarray(requests[i].prompt_tokens, np.int32),
            tokens=np.asarray(tokens[i], np.int32),
            logprobs=np.asarray(logprobs[i], np.float32),
            version=version,
            finish_reason=reason.label,
        )
        return True

    while pending or any(o is not None for o in owner):
        free = [s for s, o in enumerate(owner) if o is None]
        stopped: list[int] = []
        if pending and free:
            batch = [pending.popleft() for _ in range(min(len(free), len(pending)))]
            by_bucket: dict[int, list[int]] = collections.defaultdict(list)
            for i in batch:
                by_bucket[engine.bucket_for(len(requests[i].prompt_tokens))].append(i)
            for group in by_bucket.values():
                slots, free = free[: len(group)], free[len(group) :]
                prefix, first = engine.prefill_requests(params, [requests[i] for i in group])
                decode_state = engine.insert(prefix, decode_state, slots)
                first = first.convert_to_numpy()
                for row, (slot, i) in enumerate(zip(slots, group, strict=True)):
                    done = take(
                        i,
                        int(first.tokens[row]),
                        float(first.log_probs[row, 0]),
                        int(first.finish_reasons[row]),
                    )
                    if done:
                        if first.finish_reasons[row] == FinishReason.NONE:
                            stopped.append(slot)
                    else:
                        owner[slot] = i
        if stopped:
            decode_state = engine.free_slot(decode_state, stopped)
            stopped = []
        if not any(o is not None for o in owner):
            continue
        decode_state, result = engine.generate(params, decode_state)
        result = result.convert_to_numpy()
        for slot, i in enumerate(owner):
            if i is None or not result.valid[slot]:
                continue
            finish = int(result.finish_reasons[slot])
            done = take(i, int(result.tokens[slot]), float(result.log_probs[slot, 0]), finish)
            if done:
                owner[slot] = None
                if finish == FinishReason.NONE:
                    stopped.append(slot)
        if stopped:
            decode_state = engine.free_slot(decode_state, stopped)
    return results  # type: ignore[return-value]
