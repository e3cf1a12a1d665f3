"""The run's prompt stream, its reward adapter (the task's reward plus the overlong penalty,
scored side by side), and when held-out scores are due."""

from __future__ import annotations

import os
import threading
import types

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from configs import default
from dora_jax import settings_lib, task_lib
from dora_jax.rewards import RewardRunner, get_reward
from dora_jax.rewards.shaping_lib import OverlongPenalty

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_trained_reward_is_the_tasks_plus_the_overlong_penalty():
    config = default.get_config()
    config.reward.overlong_buffer = 8
    config.reward.overlong_penalty = 0.5
    settings = settings_lib.validate(config)  # engine.max_decode_length = 48: penalised past 40
    records = iter([{"prompt_tokens": [1, 2], "answer": "7"}] * 4)
    prompts = task_lib.PromptStream(records, group_size=4, max_new_tokens=48)
    prompts(0)
    # Tokens below 10 decode to their digit, the others to spaces, which exact_match strips.
    tokenizer = types.SimpleNamespace(
        decode=lambda ids: "".join(str(t) if t < 10 else " " for t in ids)
    )
    runner = RewardRunner(get_reward("exact_match"), timeout_s=5.0)
    reward = task_lib.RewardAdapter(runner, tokenizer, prompts, settings.overlong)
    right, wrong = [7], [3]
    responses = [right, [10] * 43 + right, [10] * 47 + wrong, [10] * 39 + wrong]
    scored = reward([((0, j), np.asarray(t, np.int32)) for j, t in enumerate(responses)])
    assert scored == [1.0, 1.0 - 0.5 * 4 / 8, -0.5, 0.0]
    assert reward.metrics()["reward/overlong_penalized"] == 2
    assert reward.metrics()["reward/calls"] == 4


def test_a_prompts_record_is_dropped_once_its_group_is_scored():
    records = iter([{"prompt_tokens": [i], "answer": str(i)} for i in range(3)])
    prompts = task_lib.PromptStream(records, group_size=2, max_new_tokens=4)
    for prompt_id in range(3):
        prompts(prompt_id)
    assert prompts.answer(1) == prompts.answer(1) == "1"
    assert sorted(prompts.records) == [0, 2]  # a run no longer holds every prompt it read
    assert prompts.answer(0) == "0" and prompts.answer(2) == "2"


def test_a_turns_samples_are_scored_concurrently():
    """The rollout hands the reward a turn's finished samples at once: a reward that waits
    (a sandbox, a judge) runs them side by side. Four calls meet at a barrier of four, which
    breaks (an error, scored 0) unless all four are in flight together."""
    barrier = threading.Barrier(4)

    def meet(completion, answer):
        barrier.wait(timeout=10)
        return 1.0

    prompts = task_lib.PromptStream(iter([{"prompt_tokens": [1], "answer": "x"}]), 4, 8)
    prompts(0)
    runner = RewardRunner(meet, timeout_s=20.0, workers=4, isolation="thread")
    tokenizer = types.SimpleNamespace(decode=lambda ids: "y")
    overlong = settings_lib.validate(default.get_config()).overlong
    reward = task_lib.RewardAdapter(runner, tokenizer, prompts, overlong)
    assert reward([((0, j), np.asarray([1], np.int32)) for j in range(4)]) == [1.0] * 4
    assert runner.counters.errors == 0


@given(st.integers(1, 30), st.integers(1, 12), st.integers(1, 200))
def test_held_out_is_scored_at_the_first_barrier_at_or_after_each_multiple(every, barrier, n):
    """Barriers every `barrier` versions and at the last, `n`, which may be off that grid: it
    scored again a multiple the grid's last barrier had already scored."""
    barriers = sorted({*range(barrier, n + 1, barrier), n})
    expected = {next((b for b in barriers if b >= m), None) for m in range(every, n + 1, every)}
    got = {v for v in barriers if task_lib.held_out_due(v, every, barrier)}
    assert got == expected - {None}
    assert not any(task_lib.held_out_due(v, 0, barrier) for v in barriers)


def _always_raises(completion: str, answer: str) -> float:
    raise KeyError("answer")  # a reward written for another dataset's fields


def test_a_run_whose_every_reward_call_fails_says_so_once(caplog):
    """Each failing call is one warning among many and scores 0: a run whose reward never
    works learned nothing and ended as if fine. Past `ALL_FAILED_AFTER` calls it says so."""
    n = task_lib.ALL_FAILED_AFTER
    tokenizer = types.SimpleNamespace(decode=lambda ids: "x")
    for fn, says in ((_always_raises, True), (get_reward("exact_match"), False)):
        prompts = task_lib.PromptStream(
            iter([{"prompt_tokens": [1], "answer": "x"}] * n), group_size=n, max_new_tokens=4
        )
        prompts(0)
        runner = RewardRunner(fn, timeout_s=5.0, isolation="thread")
        reward = task_lib.RewardAdapter(runner, tokenizer, prompts, OverlongPenalty(8))
        caplog.clear()
        reward([((0, j), np.asarray([1], np.int32)) for j in range(n - 1)])
        assert not any("every one of" in m for m in caplog.messages)
        # Each failure names its sample as the ledger does, not just its prompt.
        named = {m.split(" failed")[0] for m in caplog.messages if m.startswith("reward for")}
        assert named == ({f"reward for sample (0, {j})" for j in range(n - 1)} if says else set())
        reward([((0, 0), np.asarray([1], np.int32))])
        reward.prompts = task_lib.PromptStream(
            iter([{"prompt_tokens": [1], "answer": "x"}]), group_size=1, max_new_tokens=4
        )
        reward.prompts(0)
        reward([((0, 0), np.asarray([1], np.int32))])  # once only
        warned = [m for m in caplog.messages if "every one of the run's" in m]
        assert len(warned) == (1 if says else 0)
