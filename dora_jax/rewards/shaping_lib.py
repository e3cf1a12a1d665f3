"""Length-aware reward shaping: DAPO's soft overlong punishment.

A response cut off at the length limit usually carries no answer, so its task reward is 0 like
a wrong one: the policy learns nothing about *why* it failed. DAPO (arXiv 2503.14476, section
3.4) adds a penalty that grows linearly over the last `buffer` tokens before the limit, from 0
at `max_length - buffer` to `-factor` at `max_length`, so the policy is told to finish earlier
before it is told it was wrong. Shorter responses are untouched.

The penalty shapes the reward the trainer sees (the ledger records it too, since that is what
was trained on); held-out evaluation scores the task reward alone. The truncated samples are
still trained: shaping replaces DAPO's other option, masking them out of the loss
(`train.mask_truncated`), without losing their signal.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """The penalty of a response of `length` tokens under a limit of `max_length` tokens.

    `buffer` = 0 turns it off. Errors name the `reward.overlong_*` config fields they come from.
    """

    max_length: int
    buffer: int = 0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.buffer <= self.max_length:
            raise ValueError(
                f"reward.overlong_buffer: {self.buffer} must be in [0, {self.max_length}] "
                "(the response length limit)"
            )
        if not self.factor >= 0:
            raise ValueError(f"reward.overlong_penalty: {self.factor} must be >= 0")

    def __call__(self, length: int) -> float:
        if self.buffer == 0:
            return 0.0
        excess = length - (self.max_length - self.buffer)
        if excess <= 0:
            return 0.0
        return -self.factor * min(excess, self.buffer) / self.buffer
