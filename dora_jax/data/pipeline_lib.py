"""The prompt pipeline: rows -> shuffled, repeated, validated, templated, tokenized prompts.

A real grain pipeline (`MapDataset` -> shuffle(seed) -> repeat(epochs) -> map ->
`IterDataset`), so its position is a grain iterator state that the checkpointer saves and a
resumed run continues from exactly.

Malformed rows (missing field, wrong type, undecodable text, invalid JSON), prompts that
tokenize to no token at all (the engine rejects them) and prompts longer than `max_prompt_len`
tokens are never dropped silently and never crash a reader thread: the map step turns them into
a bad-row marker, and the last stage either stops the run with an error naming the file, row
and field (`on_bad_row="error"`) or skips them, logging each one and counting it by reason
(`on_bad_row="skip"`). The counts are part of the iterator state, so they
survive a resume without double counting. Whether a row is usable depends on the row alone, so a
whole epoch without a usable row means no row will ever be usable: skipping then stops with a
`NoUsableRowsError` instead of reading the repeated data forever.

Each prompt record is a dict:
  * `prompt_id`: `epoch * num_rows + row_index` - stable for a given file list and seed, and
    unique across epochs, so a prompt seen again in a later epoch is a new prompt group.
  * `row`: the row's global index (the same in every epoch).
  * `prompt_tokens`: int32 array; `answer`: str (numbers in the answer field become strings).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

import grain
import numpy as np

from dora_jax.data.source_lib import Row, RowSource
from dora_jax.data.template_lib import PromptTemplate
from dora_jax.data.tokenizer_lib import Tokenizer

BAD_ROW_MODES = ("skip", "error")
_log = logging.getLogger(__name__)


class BadRowError(ValueError):
    """A malformed row under `on_bad_row="error"`; the message names file, row and field."""


class NoUsableRowsError(ValueError):
    """A whole pass over the data yielded no usable row; the message names the files and counts."""


class _Bad(Exception):
    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(detail)
        self.reason, self.field, self.detail = reason, field, detail


def _text(value: Any, field: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Bad("undecodable", field, f"field {field!r} is not valid UTF-8: {e}") from e
    if not isinstance(value, str):
        raise _Bad(
            "wrong_type", field, f"field {field!r} must be a string, got {type(value).__name__}"
        )
    try:
        value.encode("utf-8")  # lone surrogates from JSON "\ud800" escapes
    except UnicodeEncodeError as e:
        raise _Bad("undecodable", field, f"field {field!r} is not valid Unicode: {e}") from e
    return value


def _fields(payload: Any, prompt_field: str, answer_field: str) -> tuple[str, str]:
    if isinstance(payload, bytes):
        if not payload.strip():
            raise _Bad("invalid_json", "<row>", "row is a blank line")
        try:
            payload = json.loads(payload.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _Bad("undecodable", "<row>", f"row is not valid UTF-8: {e}") from e
        except json.JSONDecodeError as e:
            raise _Bad("invalid_json", "<row>", f"row is not valid JSON: {e}") from e
    if not isinstance(payload, dict):
        raise _Bad("wrong_type", "<row>", f"row must be an object, got {type(payload).__name__}")
    for field in (prompt_field, answer_field):
        if field not in payload or payload[field] is None:
            raise _Bad("missing_field", field, f"field {field!r} is missing")
    answer = payload[answer_field]
    if isinstance(answer, float) and answer.is_integer():
        # A column of integers with one gap is float to pandas and Parquet: its 4 must read
        # "4", as the model writes it, not "4.0".
        answer = int(answer)
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    return _text(payload[prompt_field], prompt_field), _text(answer, answer_field)


def prompt_tokens(tokenizer: Tokenizer, template: PromptTemplate, prompt: str) -> list[int]:
    """A prompt's tokens as the pipeline gives them to the engine: rendered by `template`, with
    the tokenizer's special tokens unless the template writes its own."""
    return tokenizer.encode(
        template.render(prompt), add_special_tokens=not template.writes_special_tokens
    )


class _Prepare:
    """The map step: a `Row` -> a prompt record, or a bad-row marker (never an exception)."""

    def __init__(
        self,
        num_rows: int,
        tokenizer: Tokenizer,
        template: PromptTemplate,
        prompt_field: str,
        answer_field: str,
        max_prompt_len: int,
    ):
        self.num_rows, self.tokenizer, self.template = num_rows, tokenizer, template
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.max_prompt_len = max_prompt_len

    def __call__(self, index: int, row: Row) -> dict:
        try:
            prompt, answer = _fields(row.payload, self.prompt_field, self.answer_field)
            tokens = prompt_tokens(self.tokenizer, self.template, prompt)
            if not tokens:  # the engine cannot prefill a prompt without a token
                raise _Bad(
                    "empty_prompt",
                    self.prompt_field,
                    "prompt is empty: it has 0 tokens after the template and the tokenizer",
                )
            if len(tokens) > self.max_prompt_len:
                raise _Bad(
                    "prompt_too_long",
                    self.prompt_field,
                    f"prompt has {len(tokens)} tokens, more than max_prompt_len="
                    f"{self.max_prompt_len}",
                )
        except _Bad as bad:
            # `index` (the position in the repeated stream) tells the iterator where epochs end.
            return {"bad": bad.reason, "file": row.file, "position": row.position,
                    "field": bad.field, "detail": bad.detail, "index": index}  # fmt: skip
        epoch = index // self.num_rows
        return {
            "prompt_id": epoch * self.num_rows + row.index,
            "row": row.index,
            "prompt_tokens": np.asarray(tokens, np.int32),
            "answer": answer,
        }


class PromptIterator(grain.DatasetIterator):
    """Yields good prompt records; skips-and-counts or raises on bad rows.

    `skipped` maps a reason (`missing_field`, `wrong_type`, `undecodable`, `invalid_json`,
    `empty_prompt`, `prompt_too_long`) to how many rows were skipped for it; it is saved in the
    state. Skipping raises `NoUsableRowsError` at the end of an epoch that yielded no good row.
    """

    def __init__(
        self,
        parent: grain.DatasetIterator,
        on_bad_row: str,
        *,
        num_rows: int,
        files: Sequence[str],
    ):
        super().__init__(parent)
        self._on_bad_row = on_bad_row
        self._num_rows, self._files = num_rows, tuple(files)
        self.skipped: collections.Counter[str] = collections.Counter()
        # The newest epoch that yielded a good row (-1: none yet). It is part of the state, so
        # an epoch cut by a checkpoint is judged whole after the resume.
        self._last_good_epoch: int | None = -1

    def __next__(self) -> dict:
        while True:
            element = next(self._parent)
            if "bad" not in element:
                self._last_good_epoch = element["prompt_id"] // self._num_rows
                return element
            where = f"{element['file']} {element['position']} field {element['field']!r}"
            if self._on_bad_row == "error":
                raise BadRowError(f"bad data row: {where}: {element['detail']}")
            self.skipped[element["bad"]] += 1
            _log.warning("skipping bad data row: %s: %s", where, element["detail"])
            self._check_epoch_end(element["index"])

    def _check_epoch_end(self, index: int) -> None:
        epoch = index // self._num_rows
        if self._last_good_epoch is None:  # restored from a state that predates the field:
            self._last_good_epoch = epoch  # unknown, so this epoch is given the benefit
        if index % self._num_rows == self._num_rows - 1 and self._last_good_epoch < epoch:
            counts = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
            raise NoUsableRowsError(
                f"no usable row in a whole pass over the {self._num_rows} rows of data files "
                f"{list(self._files)}: every row is bad and skipped (on_bad_row='skip'); rows "
                f"skipped so far by reason: {counts}"
            )

    def get_state(self) -> dict:
        return {
            "parent": self._parent.get_state(),
            "skipped": dict(self.skipped),
            "last_good_epoch": self._last_good_epoch,
        }

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self.skipped = collections.Counter(state["skipped"])
        self._last_good_epoch = state.get("last_good_epoch")


class _PromptDataset(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, on_bad_row: str, source: RowSource):
        super().__init__(parent)
        self._on_bad_row, self._source = on_bad_row, source

    def __iter__(self) -> PromptIterator:
        return PromptIterator(
            self._parent.__iter__(),
            self._on_bad_row,
            num_rows=len(self._source),
            files=self._source.files,
        )


def prompt_dataset(
    source: RowSource,
    tokenizer: Tokenizer,
    template: PromptTemplate,
    *,
    max_prompt_len: int,
    seed: int,
    num_epochs: int | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    on_bad_row: Literal["skip", "error"] = "skip",
    read_threads: int = 2,
) -> grain.IterDataset:
    """The prompt stream; `iter()` of it is a `PromptIterator` (checkpointable, with `skipped`).

    `num_epochs=None` repeats forever; each epoch is a fresh permutation derived from `seed`.
    Under `on_bad_row="skip"`, an epoch without a usable row raises `NoUsableRowsError`.
    """
    if on_bad_row not in BAD_ROW_MODES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_MODES}, got {on_bad_row!r}")
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    prepare = _Prepare(len(source), tokenizer, template, prompt_field, answer_field, max_prompt_len)
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(num_epochs)
    ds = ds.map_with_index(prepare)
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(16, read_threads))
    return _PromptDataset(ds.to_iter_dataset(read), on_bad_row, source)
