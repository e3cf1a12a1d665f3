"""Reward registry (selected by config name or dotted path) and the fault-tolerant runner."""

from dora_jax.rewards.registry_lib import (
    RewardFn,
    exact_match,
    format_reward,
    get_reward,
    math_reward,
    register_reward,
    registered_rewards,
)
from dora_jax.rewards.runner_lib import RewardCounters, RewardRunner

__all__ = [
    "RewardCounters",
    "RewardFn",
    "RewardRunner",
    "exact_match",
    "format_reward",
    "get_reward",
    "math_reward",
    "register_reward",
    "registered_rewards",
]
