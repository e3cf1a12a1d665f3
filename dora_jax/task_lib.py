"""The task a run trains on: prompts from the data pipeline, their reward, and held-out scores.

`PromptStream` feeds rollout one group's prompt at a time and keeps each record only until its
group is scored; `RewardAdapter` scores finished samples through the timeout-safe reward runner
plus the overlong penalty; `evaluate` gives held-out pass@1 / pass@k with the engine and the
same reward.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from dora_jax.config_fields_lib import ConfigError
from dora_jax.data import (
    LongTailTask,
    MissingFieldError,
    NoUsableRowsError,
    Tokenizer,
    file_list,
    load_tokenizer,
    make_template,
    memory_rows,
    open_files,
    prompt_dataset,
)
from dora_jax.engine import Engine, Request, TextStream, generate_all
from dora_jax.rewards import RewardRunner
from dora_jax.rewards.shaping_lib import OverlongPenalty
from dora_jax.rollout.request_lib import PromptSpec
from dora_jax.settings_lib import eval_sampling, longtail_task, stop_strings


@dataclasses.dataclass
class TaskData:
    tokenizer: Tokenizer
    train_rows: Any  # a RowSource
    heldout_rows: Any  # a RowSource, or None: no held-out evaluation
    demonstrations: list[tuple[str, str]]
    task: LongTailTask | None


def load_task(config: ml_collections.ConfigDict) -> TaskData:
    if config.data.source == "longtail":
        task = longtail_task(config)
        train = task.rows("train", 20_000, seed=config.seed)
        heldout = memory_rows(task.rows("heldout", config.eval.num_prompts, config.seed + 1))
        demos = task.demonstrations(
            task.rows("train", 20_000, seed=config.seed + 2),
            config.task.demonstration_noise,
            seed=config.seed,
        )
        return TaskData(task.tokenizer(), memory_rows(train, "longtail"), heldout, demos, task)
    train = _open_field(config, "train_files")
    heldout = _open_field(config, "heldout_files") if file_list(config.data.heldout_files) else None
    return TaskData(load_tokenizer(config.model.checkpoint), train, heldout, [], None)


def _open_field(config: ml_collections.ConfigDict, field: str) -> Any:
    """The rows of `data.<field>`'s files; a file that cannot be read as data (empty, of an
    unknown format, unreadable) refuses the run, naming the field, and one whose rows lack the
    prompt or answer field names that field."""
    names = {"prompt_field": config.data.prompt_field, "answer_field": config.data.answer_field}
    try:
        return open_files(file_list(config.data[field]), tuple(names.values()))
    except MissingFieldError as e:
        name = next(n for n, value in names.items() if value == e.field)
        raise ConfigError(f"data.{name}={e.field!r}: {e}") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.{field}: {e}") from e


class PromptStream:
    """Rollout's prompt source: prompt id i is the next record of the grain pipeline.

    Rollout asks for prompt ids in order, once each; a record is kept until every sample of its
    group has been scored (each sample is scored once), so that its answer is known then and a
    long run does not hold every prompt it ever read. A resumed run starts at `first_id` with
    the iterator restored to the matching position (the checkpoint barrier leaves no prompt
    half-used).
    """

    def __init__(
        self,
        iterator: Any,
        group_size: int,
        max_new_tokens: int,
        first_id: int = 0,
        stop_strings: tuple[str, ...] = (),
        text_stream: Callable[[], TextStream] | None = None,
    ):
        self.iterator = iterator
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.stop_strings = stop_strings
        self.text_stream = text_stream
        self.next_id = first_id
        self.records: dict[int, dict[str, Any]] = {}
        self._scored: collections.Counter[int] = collections.Counter()

    def __call__(self, prompt_id: int) -> PromptSpec:
        if prompt_id not in self.records:
            if prompt_id != self.next_id:
                raise ValueError(f"prompt {prompt_id} requested out of order ({self.next_id})")
            self.records[prompt_id] = next(self.iterator)
            self.next_id += 1
        record = self.records[prompt_id]
        return PromptSpec(
            prompt_id,
            np.asarray(record["prompt_tokens"], np.int32),
            (self.max_new_tokens,) * self.group_size,
            stop_strings=self.stop_strings,
            text_stream=self.text_stream,
        )

    def answer(self, prompt_id: int) -> str:
        """The reference answer for one sample of the group about to be scored."""
        answer = self.records[prompt_id]["answer"]
        self._scored[prompt_id] += 1
        if self._scored[prompt_id] == self.group_size:
            del self.records[prompt_id], self._scored[prompt_id]
        return answer


# Reward calls after which, if every one failed, the run says so once: each failure is logged
# as a warning among many, scores 0, and a run that learns nothing otherwise ends "fine".
ALL_FAILED_AFTER = 32


class RewardAdapter:
    """((prompt id, sample index), response tokens) -> reward: the task's, through the
    timeout-safe `RewardRunner`, plus the overlong penalty of the response's length."""

    def __init__(
        self,
        runner: RewardRunner,
        tokenizer: Tokenizer,
        prompts: PromptStream,
        overlong: OverlongPenalty,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.overlong = overlong
        self.penalized = 0
        self._said_all_failed = False

    def __call__(self, batch: Sequence[tuple[tuple[int, int], np.ndarray]]) -> list[float]:
        """A turn's finished samples, scored by the runner's workers together; a failure's
        warning names the sample as the ledger does, (prompt id, sample index)."""
        items = [
            (key, self.tokenizer.decode([int(t) for t in tokens]), self.prompts.answer(key[0]))
            for key, tokens in batch
        ]
        rewards = []
        for reward, (_, tokens) in zip(self.runner.score(items), batch, strict=True):
            penalty = self.overlong(len(tokens))
            self.penalized += penalty < 0
            rewards.append(reward + penalty)
        self._check_not_all_failed()
        return rewards

    def _check_not_all_failed(self) -> None:
        c = self.runner.counters
        if self._said_all_failed or c.calls < ALL_FAILED_AFTER or c.errors + c.timeouts < c.calls:
            return
        self._said_all_failed = True
        logging.warning(
            "every one of the run's %d reward calls so far failed (%d errors, %d timeouts): "
            "every reward is 0 and the policy learns nothing; check reward.name and the "
            "function (the warnings above name each failure)",
            c.calls,
            c.errors,
            c.timeouts,
        )

    def restore_metrics(self, saved: dict[str, float]) -> None:
        """Continues the counters `metrics()` returned when a checkpoint was saved."""
        self.runner.restore_metrics(saved)
        self.penalized = int(saved.get("reward/overlong_penalized", 0))

    def metrics(self) -> dict[str, float]:
        """Cumulative counters, the reward runner's and the overlong penalty's."""
        return {
            **{k: float(v) for k, v in self.runner.metrics().items()},
            "reward/overlong_penalized": float(self.penalized),
        }


# -- held-out evaluation ------------------------------------------------------------------------


def heldout_records(config: ml_collections.ConfigDict, data: TaskData) -> list[dict[str, Any]]:
    """The first `eval.num_prompts` held-out prompts, through the same pipeline as training
    (template, tokenizer, length limit, bad-row policy)."""
    if data.heldout_rows is None:
        return []
    iterator = iter(prompt_records(config, data, data.heldout_rows, num_epochs=1))
    try:
        return [record for record, _ in zip(iterator, range(config.eval.num_prompts), strict=False)]
    except NoUsableRowsError as e:  # named by its field: the training files may be fine
        raise ConfigError(f"data.heldout_files: {e}") from e


def held_out_due(version: int, every: int, barrier_every: int) -> bool:
    """Whether the checkpoint barrier of `version` scores the held-out set: the first barrier
    at or after each multiple of `every` (0: none), i.e. one with a multiple of `every` among
    the versions since the previous barrier. Barriers fall every `barrier_every` versions, and
    at the last version, which may be off that grid: its previous barrier is the grid's."""
    previous = (version - 1) // barrier_every * barrier_every
    return bool(every) and version // every > previous // every


def evaluate(
    engine: Engine,
    params: Any,
    records: Sequence[dict[str, Any]],
    config: ml_collections.ConfigDict,
    runner: RewardRunner,
    tokenizer: Tokenizer,
) -> dict[str, float]:
    """pass@1 (mean over k samples) and pass@k on the held-out prompts, sampled as
    `eval_sampling` says."""
    if not records:
        return {}
    k = config.eval.samples_per_prompt
    stops = stop_strings(config)
    sampling = eval_sampling(config)
    requests = [
        Request(
            prompt_tokens=record["prompt_tokens"],
            seed=10_000 * i + j,
            id=(i, j),
            stop_strings=stops,
            sampling=sampling,
        )
        for i, record in enumerate(records)
        for j in range(k)
    ]
    completions = generate_all(engine, params, requests, text_stream=tokenizer.text_stream)
    scores = np.asarray(
        runner.score(
            [(c.id, tokenizer.decode(c.tokens), records[c.id[0]]["answer"]) for c in completions],
            counted=False,
        )
    ).reshape(len(records), k)
    correct = scores >= 1.0
    return {"pass@1": float(correct.mean()), f"pass@{k}": float(correct.any(axis=1).mean())}


def prompt_records(
    config: ml_collections.ConfigDict, data: TaskData, rows: Any, num_epochs: int | None = None
) -> Any:
    """`rows` through the data pipeline as the config sets it: template, tokenizer, prompt
    length limit, bad-row policy; each record a tokenized prompt and its answer."""
    builtin = data.task is not None
    return prompt_dataset(
        rows,
        data.tokenizer,
        make_template(config.data.template, config.model.checkpoint or None),
        max_prompt_len=config.data.max_prompt_len,
        seed=config.seed,
        prompt_field="prompt" if builtin else config.data.prompt_field,
        answer_field="answer" if builtin else config.data.answer_field,
        on_bad_row=config.data.on_bad_row,
        num_epochs=num_epochs,
    )
