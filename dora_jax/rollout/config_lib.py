"""Rollout configuration (`config.rollout`), validated up front with errors naming the field."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import ml_collections

from dora_jax.config_fields_lib import dataclass_section, from_fields, is_count
from dora_jax.train.config_lib import TrainConfig

# Set once for the whole run, as the config's top-level `seed`.
RUN_FIELDS = ("seed",)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    mode: str = "dora"  # a name in paradigms_lib.PARADIGMS
    train_batch_size: int = 8  # TBS: samples per training iteration
    rollout_batch_size: int = 16  # RBS: samples kept in flight (dora, partial)
    group_size: int = 4  # G: samples per prompt
    staleness_bound: int = 2  # K: max trainer_version - sample_version (dora, partial)
    num_iterations: int = 4
    timer_steps: int = 16  # the orchestrator's periodic trigger, in decode steps
    kv_pressure: float = 0.9  # KV-cache fill fraction of an instance that triggers it
    # Decode steps between the start of a training step and the use of its new version: the
    # logical time the trainer is given, so decisions never depend on wall-clock races.
    publish_delay_steps: int = 4
    # Decode steps each instance runs per engine call (a turn of the loop): more amortise the
    # controller's per-call cost (vLLM's multi-step scheduling), but a finished request's slot
    # is refilled, and a new version taken up, only between calls.
    decode_steps_per_turn: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        from dora_jax.rollout import paradigms_lib  # registry; imported late to avoid a cycle

        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"rollout.{field}={getattr(self, field)!r}: {why}")

        if self.mode not in paradigms_lib.PARADIGMS:
            raise bad(
                "mode", f"unknown paradigm, expected one of {sorted(paradigms_lib.PARADIGMS)}"
            )
        for field in (
            "train_batch_size",
            "rollout_batch_size",
            "group_size",
            "num_iterations",
            "timer_steps",
            "decode_steps_per_turn",
        ):
            if not is_count(getattr(self, field), 1):
                raise bad(field, "must be a positive integer")
        for field in ("staleness_bound", "publish_delay_steps"):
            if not is_count(getattr(self, field), 0):
                raise bad(field, "must be an integer >= 0")
        if self.train_batch_size % self.group_size:
            raise bad("train_batch_size", f"must be a multiple of group_size={self.group_size}")
        if self.rollout_batch_size % self.group_size:
            raise bad("rollout_batch_size", f"must be a multiple of group_size={self.group_size}")
        if self.mode in ("dora", "partial") and self.rollout_batch_size < self.train_batch_size:
            raise bad(
                "rollout_batch_size",
                f"must be >= train_batch_size={self.train_batch_size} in {self.mode} mode",
            )
        if not 0 < self.kv_pressure <= 1:
            raise bad("kv_pressure", "must be in (0, 1]")

    @classmethod
    def from_dict(cls, d: Any) -> RolloutConfig:
        """From `config.rollout` (a dict or ConfigDict); unknown keys are an error."""
        return from_fields(cls, d, "rollout")

    @property
    def groups_per_batch(self) -> int:
        return self.train_batch_size // self.group_size


def config_section(**values: Any) -> ml_collections.ConfigDict:
    """A config file's `rollout` section: every field a user may set, at its default unless
    given here (`config_fields_lib.dataclass_section`)."""
    elsewhere = {f: f"set it once, as the config's top-level {f}" for f in RUN_FIELDS}
    return dataclass_section(RolloutConfig, "rollout", values, elsewhere)


def train_config(rollout: RolloutConfig, train: Any, temperature: float) -> TrainConfig:
    """The trainer's config: `train` (a dict or ConfigDict) plus what the rollout fixes.

    TBS and G are set once, in `rollout`; the trainer's staleness guard is the paradigm's own
    bound (sync 0, one_step_off 1, otherwise K), a second line of defence for C3. The policy
    trained samples at the engines' `temperature` (`engine.temperature`).
    """
    from dora_jax.rollout import paradigms_lib  # registry; imported late to avoid a cycle

    fields = dict(train.to_dict() if hasattr(train, "to_dict") else train)
    for shared in ("tbs", "group_size"):
        if shared in fields:
            raise ValueError(f"train.{shared}: set it once, as rollout.train_batch_size/group_size")
    try:
        return TrainConfig.from_dict(
            {
                **fields,
                "tbs": rollout.train_batch_size,
                "group_size": rollout.group_size,
                "max_staleness": paradigms_lib.PARADIGMS[rollout.mode]().bounds(rollout)[0],
                "temperature": temperature,
            }
        )
    except ValueError as e:  # the trainer's names for what the user set elsewhere
        message = str(e)
        for trainers, users in _SET_ELSEWHERE:
            message = re.sub(trainers, users, message)
        raise ValueError(message) from e


_SET_ELSEWHERE = (
    (r"\btrain\.group_size\b", "rollout.group_size"),
    (r"(?<![\w.])group_size=", "rollout.group_size="),
    (r"\btrain\.tbs\b", "rollout.train_batch_size"),
    (r"(?<![\w.])tbs\b", "rollout.train_batch_size"),
    (r"\btrain\.temperature\b", "engine.temperature"),
)
