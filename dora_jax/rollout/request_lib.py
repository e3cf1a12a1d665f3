"""A sample while it is being generated, and the prompt workload it comes from.

A `Request` is bound to one policy version before it starts; every token it gets is recorded
with the version of the params that sampled it, so the finished `Trajectory` proves C1 (or, in
the `partial` paradigm, shows where it broke).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from dora_jax.engine.request_lib import StopMatcher, TextStream
from dora_jax.rollout.trajectory_lib import Trajectory


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """One prompt and the generation limit of each of its G samples.

    `ignore_eos` with per-sample `max_new_tokens` forces response lengths, so every paradigm
    does identical work on a benchmark workload. `stop_strings` end a response at the first
    token whose text completes one (it stays in the response); they need `text_stream`, the
    tokenizer's (`Tokenizer.text_stream`).
    """

    prompt_id: int
    tokens: np.ndarray  # int32 [prompt_len]
    max_new_tokens: tuple[int, ...]  # one per sample of the group
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    text_stream: Callable[[], TextStream] | None = None


PromptSource = Callable[[int], PromptSpec]  # prompt_id -> spec, deterministic
# ((prompt id, sample index), response tokens) of every sample finished in one turn -> their
# rewards, in order. One call per turn, not per sample: a reward that waits on something (a
# sandbox running code, a judge model) scores the turn's samples concurrently while the
# instances wait once. The sample index is there to name the sample when its reward fails.
TurnRewardFn = Callable[[Sequence[tuple[tuple[int, int], np.ndarray]]], Sequence[float]]


def per_sample(fn: Callable[[int, np.ndarray], float]) -> TurnRewardFn:
    """The `TurnRewardFn` scoring each sample with `fn(prompt_id, tokens)`, one after another."""
    return lambda batch: [fn(key[0], tokens) for key, tokens in batch]


@dataclasses.dataclass
class Request:
    prompt: PromptSpec
    sample_index: int
    seed: int
    version: int  # the version this sample is bound to (its behaviour version once started)
    started: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    truncated: bool = False
    # The prompt's stop strings, matched on the response so far (None: it has none).
    stop: StopMatcher | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self._new_stop()

    def _new_stop(self) -> None:
        spec = self.prompt
        if spec.stop_strings:
            self.stop = StopMatcher(stop_strings=spec.stop_strings, text_stream=spec.text_stream)

    @property
    def key(self) -> tuple[int, int]:
        return (self.prompt.prompt_id, self.sample_index)

    @property
    def max_new_tokens(self) -> int:
        return self.prompt.max_new_tokens[self.sample_index]

    def prefill_seed(self) -> int:
        """The sampling seed of this request's next prefill. The engine keys token i of a
        prefill on (seed, i), counting from that prefill; a request re-prefilled after n tokens
        (`partial`'s weight update) gets a seed of its own for the rest, or its token n + i
        would be drawn with token i's key, and its behaviour log-probs would not describe how
        its continuation was really sampled."""
        if not self.tokens:
            return self.seed
        rng = np.random.default_rng([self.seed, len(self.tokens)])
        return int(rng.integers(2**31))

    def record(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))
        self.token_versions.append(int(version))

    def restart(self, version: int) -> None:
        """Drops everything generated (a failed instance): regenerate from scratch."""
        self.version = version
        self.started = False
        self.tokens.clear()
        self.logprobs.clear()
        self.token_versions.clear()
        self._new_stop()

    def to_trajectory(self, reward: float) -> Trajectory:
        return Trajectory(
            prompt_id=self.prompt.prompt_id,
            sample_index=self.sample_index,
            prompt_tokens=np.asarray(self.prompt.tokens, np.int32),
            response_tokens=np.asarray(self.tokens, np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, np.float32),
            version=self.token_versions[0] if self.token_versions else self.version,
            token_versions=np.asarray(self.token_versions, np.int32),
            reward=float(reward),
            truncated=self.truncated,
        )


def heavy_tail_prompts(
    *,
    seed: int,
    group_size: int,
    vocab_size: int,
    prompt_length: int = 8,
    median_length: int = 8,
    max_length: int = 256,
    sigma: float = 1.4,
    first_token: int = 1,
) -> PromptSource:
    """Random prompts whose responses are forced to log-normal lengths (p99/median ~ e^(2.33s)).

    With the default sigma of 1.4, p99/median is about 26, like the DORA paper's math rollouts
    (30K max vs 2.4K mean); lengths are clipped to [1, max_length].
    """

    def spec(prompt_id: int) -> PromptSpec:
        rng = np.random.default_rng([seed, prompt_id])
        tokens = rng.integers(first_token, vocab_size, prompt_length).astype(np.int32)
        lengths = np.exp(rng.normal(np.log(median_length), sigma, group_size))
        lengths = np.clip(np.round(lengths), 1, max_length).astype(int)
        return PromptSpec(prompt_id, tokens, tuple(int(x) for x in lengths), ignore_eos=True)

    return spec
