"""The unit of data that flows from rollout to the trainer: one finished sample.

It carries everything the three rules need. C1: `version` is the policy version that sampled
every response token, and `token_versions` records it per token so a violation (the `partial`
paradigm re-prefills under a new version mid-trajectory) is visible in the data itself.
C2/C3: (`prompt_id`, `sample_index`) identify the sample in its group of G.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Trajectory:
    prompt_id: int
    sample_index: int  # 0 .. G-1 within the prompt's group
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    response_tokens: np.ndarray  # int32 [response_len]
    # Log-prob of each response token under the distribution it was sampled from.
    behaviour_logprobs: np.ndarray  # float32 [response_len]
    version: int  # behaviour policy version (the version of the first response token)
    token_versions: np.ndarray  # int32 [response_len]; all == version unless C1 is broken
    reward: float = 0.0
    truncated: bool = False  # stopped by the length limit rather than EOS / a stop string

    def __post_init__(self) -> None:
        n = len(self.response_tokens)
        if len(self.behaviour_logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"trajectory ({self.prompt_id}, {self.sample_index}): response_tokens, "
                f"behaviour_logprobs and token_versions must have equal length, got "
                f"{n}, {len(self.behaviour_logprobs)}, {len(self.token_versions)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, for checkpoints of the trajectory queue."""
        return {
            "prompt_id": self.prompt_id,
            "sample_index": self.sample_index,
            "prompt_tokens": self.prompt_tokens.tolist(),
            "response_tokens": self.response_tokens.tolist(),
            "behaviour_logprobs": self.behaviour_logprobs.tolist(),
            "version": self.version,
            "token_versions": self.token_versions.tolist(),
            "reward": self.reward,
            "truncated": self.truncated,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(
            prompt_id=d["prompt_id"],
            sample_index=d["sample_index"],
            prompt_tokens=np.asarray(d["prompt_tokens"], np.int32),
            response_tokens=np.asarray(d["response_tokens"], np.int32),
            behaviour_logprobs=np.asarray(d["behaviour_logprobs"], np.float32),
            version=d["version"],
            token_versions=np.asarray(d["token_versions"], np.int32),
            reward=d["reward"],
            truncated=d["truncated"],
        )

    @property
    def key(self) -> tuple[int, int]:
        return (self.prompt_id, self.sample_index)

    @property
    def first_token_version(self) -> int:
        return int(self.token_versions[0]) if len(self.token_versions) else self.version

    @property
    def last_token_version(self) -> int:
        return int(self.token_versions[-1]) if len(self.token_versions) else self.version
