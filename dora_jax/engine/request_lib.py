"""What a caller asks the engine for and gets back: `Request`, `Completion`, `FinishReason`.

These are host-side records; the engine turns a request's settings into per-slot device
columns, so a request carries its own sampling, stop rules and seed wherever it decodes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dora_jax.engine.sampling_lib import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a slot stopped; `NONE` while it decodes (or never held a request)."""

    NONE = 0
    EOS = 1  # sampled one of the request's EOS ids
    LENGTH = 2  # reached max_new_tokens
    STOP = 3  # a stop sequence / stop string matched (host side, see `stop_reached`)
    ABORTED = 4  # freed by `free_slot` while still decoding

    @property
    def label(self) -> str:
        return self.name.lower()


# --------------------------------------------------------------------------------------------
# Requests and completions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    prompt_tokens: the prompt's token ids (1 .. max_prefill_length of them).
    sampling: None uses the engine's default `SamplingParams`.
    max_new_tokens: None uses the engine's max_decode_length (also the upper bound).
    ignore_eos: never stop on an EOS id (the request runs to exactly max_new_tokens).
    min_new_tokens: an EOS id or a stop rule stops the request only after at least this many
      tokens (vLLM's `min_tokens`). EOS is not masked out of the distribution, so the
      behaviour log-probs stay those of the policy.
    seed: PRNG seed; token i uses fold_in(key(seed mod 2**32), i).
    eos_ids: None uses the engine's eos_ids.
    stop_sequences / stop_strings: checked on the host after each token (`stop_reached`);
      stop strings need a detokenize callable. The matching tokens stay in the completion,
      and a match on the last token allowed reports "stop", not "length".
    id: the caller's handle, copied to the `Completion`.
    """

    prompt_tokens: Sequence[int]
    sampling: SamplingParams | None = None
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    id: Any = None
    min_new_tokens: int = 0
    eos_ids: Sequence[int] | None = None
    stop_sequences: Sequence[Sequence[int]] = ()
    stop_strings: Sequence[str] = ()


@dataclasses.dataclass
class Completion:
    """A finished request: its generated tokens and their behaviour log-probs."""

    id: Any
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n], log-prob under the distribution each was sampled from
    version: int  # the policy version of the params that produced every token
    finish_reason: str  # "eos" | "length" | "stop"

    def __len__(self) -> int:
        return len(self.tokens)


def stop_reached(
    request: Request,
    tokens: Sequence[int],
    detokenize: Callable[[Sequence[int]], str] | None = None,
) -> bool:
    """Whether the generated `tokens` end in one of the request's stop sequences or contain one
    of its stop strings (`detokenize` maps generated ids to text). Called after every token, it
    stops at the first token that completes a match, once `min_new_tokens` are generated."""
    if len(tokens) < request.min_new_tokens:
        return False
    for seq in request.stop_sequences:
        n = len(seq)
        if n and len(tokens) >= n and [int(t) for t in tokens[-n:]] == [int(t) for t in seq]:
            return True
    if request.stop_strings:
        if detokenize is None:
            raise ValueError(f"request {request.id!r} has stop_strings but no detokenize callable")
        text = detokenize([int(t) for t in tokens])
        return any(s in text for s in request.stop_strings)
    return False
