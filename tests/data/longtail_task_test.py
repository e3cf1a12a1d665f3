"""The built-in task: answers verified by an independent walker, heavy tail, disjoint splits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.data import FormatTemplate, LongTailTask, length_stats, memory_rows, prompt_dataset
from dora_jax.data.longtail_task import REWARD, SYMBOLS
from dora_jax.rewards import get_reward

TASK = LongTailTask()
TASK_TEMPLATE = FormatTemplate("{prompt}")


def reference_walk(prompt: str, modulus: int) -> str:
    """Walks the ring from the prompt alone, one step at a time, until it first reaches t."""
    assert len(prompt) == 6 and prompt[1] == "+" and prompt[3] == ">" and prompt[5] == "="
    value, step, target = (SYMBOLS.index(prompt[i]) for i in (0, 2, 4))
    out = []
    while True:
        value = (value + step) % modulus
        out.append(SYMBOLS[value])
        if value == target:
            return "".join(out)
        assert len(out) < modulus, "the walk must reach t within M-1 steps"


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), split=st.sampled_from(["train", "heldout"]),
       modulus=st.sampled_from([5, 13, 47]))  # fmt: skip
def test_answers_verify_against_an_independent_walker(seed, split, modulus):
    task = LongTailTask(modulus=modulus, max_step=3)
    reward = get_reward(REWARD)
    for row in task.rows(split, 20, seed):
        assert reference_walk(row["prompt"], modulus) == row["answer"]
        assert reward(row["answer"], row["answer"]) == 1.0
        assert reward(row["answer"][:-1], row["answer"]) == 0.0


def test_response_lengths_are_heavy_tailed_over_the_prompt_distribution():
    stats = length_stats(TASK.rows("train", 20000, seed=0))
    assert stats["p99"] / stats["p50"] >= 8, stats
    assert stats["p99_over_p50"] == stats["p99"] / stats["p50"]
    assert stats["max"] <= TASK.max_response_len
    # The same property holds for the exact distribution P(k) ~ k^-alpha (lengths k + 1).
    k = np.arange(1, TASK.modulus)
    p = k**-TASK.alpha / (k**-TASK.alpha).sum()
    cdf = np.cumsum(p)
    p50, p99 = k[np.searchsorted(cdf, 0.5)] + 1, k[np.searchsorted(cdf, 0.99)] + 1
    assert p99 / p50 >= 8 and stats["p50"] == p50


def test_length_stats_against_numpy():
    rows = [{"answer": "x" * n} for n in [1, 1, 2, 3, 40]]
    stats = length_stats(rows)
    lengths = np.array([2, 2, 3, 4, 41])
    assert stats["p50"] == 3 and stats["max"] == 41
    assert stats["p99"] == pytest.approx(np.percentile(lengths, 99))


def test_train_and_heldout_problems_are_disjoint_and_seeded():
    train = {r["prompt"] for r in TASK.rows("train", 5000, seed=1)}
    heldout = {r["prompt"] for r in TASK.rows("heldout", 2000, seed=2)}
    assert train and heldout and not train & heldout
    assert TASK.rows("train", 50, seed=3) == TASK.rows("train", 50, seed=3)
    assert TASK.rows("train", 50, seed=3) != TASK.rows("train", 50, seed=4)


def test_char_vocabulary_is_tiny_and_round_trips():
    tok = TASK.tokenizer()
    assert tok.vocab_size < 64
    for row in TASK.rows("train", 200, seed=0):
        for text in row.values():
            assert tok.decode(tok.encode(text)) == text
            assert tok.pad_id not in tok.encode(text) and 2 not in tok.encode(text)  # no <unk>


def test_demonstration_noise_rate():
    rows = TASK.rows("train", 4000, seed=0)
    assert [r for _, r in TASK.demonstrations(rows, 0.0, seed=1)] == [r["answer"] for r in rows]
    noisy = TASK.demonstrations(rows, 0.2, seed=1)
    changed = sum(a != b for row, (_, demo) in zip(rows, noisy, strict=True)
                  for a, b in zip(row["answer"], demo, strict=True))  # fmt: skip
    total = sum(len(r["answer"]) for r in rows)
    # A replacement draws the same symbol again with probability 1/M.
    assert changed / total == pytest.approx(0.2 * (1 - 1 / TASK.modulus), abs=0.01)
    assert [p for p, _ in noisy] == [r["prompt"] for r in rows]


def test_task_prompts_flow_through_the_prompt_pipeline():
    tok = TASK.tokenizer()
    rows = TASK.rows("heldout", 30, seed=0)
    ds = prompt_dataset(memory_rows(rows), tok, TASK_TEMPLATE, max_prompt_len=TASK.max_prompt_len,
                        seed=0, num_epochs=1, on_bad_row="error")  # fmt: skip
    records = list(ds)
    assert len(records) == 30
    for r in records:
        assert tok.decode(r["prompt_tokens"]) == rows[r["row"]]["prompt"]


def test_invalid_task_configs_name_the_field():
    with pytest.raises(ValueError, match="task.modulus"):
        LongTailTask(modulus=49)
    with pytest.raises(ValueError, match="task.modulus"):
        LongTailTask(modulus=59)  # 59 + 3 markers + 3 specials > 64
    with pytest.raises(ValueError, match="task.max_step"):
        LongTailTask(max_step=0)
    with pytest.raises(ValueError, match="task.heldout_fraction"):
        LongTailTask(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="split"):
        TASK.rows("test", 1, seed=0)
    with pytest.raises(ValueError, match="noise"):
        TASK.demonstrations([], 1.0, seed=0)
