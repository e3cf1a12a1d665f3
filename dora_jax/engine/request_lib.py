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
    STOP = 3  # a stop sequence / stop string matched (host side, see `StopMatcher`)
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
    stop_sequences / stop_strings: checked on the host after each token (`StopMatcher`);
      stop strings need a text stream (`generate_all(text_stream=)`). The matching tokens stay
      in the completion, and a match on the last token allowed reports "stop", not "length".
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


TextStream = Callable[[int], str]
"""A response's text, token by token: each call takes the next token id and returns the text it
adds ("" while a character is still incomplete). `Tokenizer.text_stream` makes one."""


class StopMatcher:
    """One response's stop sequences (token ids) and stop strings, checked as each token arrives.

    A stop sequence matches when the response ends in it; a stop string when the response's text
    contains it. Both count only from `min_new_tokens` on, and the first token that completes a
    match stops the request (it stays in the response). Stop strings are matched on text streamed
    token by token, so each token costs the same however long the response is: decoding the whole
    response after every token would be quadratic, and reasoning responses run to tens of
    thousands of tokens.
    """

    def __init__(
        self,
        stop_sequences: Sequence[Sequence[int]] = (),
        stop_strings: Sequence[str] = (),
        min_new_tokens: int = 0,
        text_stream: Callable[[], TextStream] | None = None,
    ):
        if any(not s for s in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)!r}")
        if stop_strings and text_stream is None:
            raise ValueError("stop_strings need a text stream (the tokenizer's `text_stream`)")
        self.sequences = [tuple(int(t) for t in s) for s in stop_sequences if len(s)]
        self.strings = tuple(stop_strings)
        self.min_new_tokens = min_new_tokens
        self._stream = text_stream() if self.strings and text_stream else None
        # Matching looks this far back: tokens for stop sequences, characters before the new
        # text for stop strings (a match completed by the next token may start there).
        self._longest_sequence = max(map(len, self.sequences), default=0)
        self._text_kept = max(map(len, self.strings), default=1) - 1
        self._recent: list[int] = []  # the last tokens, as many as the longest stop sequence
        self._count = 0
        self._text = ""  # text not searched yet, after `_text_kept` characters that were

    def step(self, token: int) -> bool:
        """Takes the response's next token; True if a stop rule matches with it."""
        self._count += 1
        if self._longest_sequence:
            self._recent = [*self._recent, int(token)][-self._longest_sequence :]
        if self._stream is not None:
            self._text += self._stream(int(token))
        if self._count < self.min_new_tokens:
            return False
        if any(tuple(self._recent[-len(s) :]) == s for s in self.sequences):
            return True
        if self._stream is None:
            return False
        found = any(s in self._text for s in self.strings)
        self._text = self._text[-self._text_kept :] if self._text_kept else ""
        return found
