"""Rows the engine cannot use: empty prompts are bad rows, and data with no usable row stops."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from dora_jax.data import (
    BadRowError,
    FormatTemplate,
    NoUsableRowsError,
    RowSource,
    char_tokenizer,
    memory_rows,
    open_files,
    prompt_dataset,
)

TOK = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ?:")
PASS_THROUGH = FormatTemplate("{prompt}")  # an empty prompt renders to an empty text
GOOD = {"prompt": "what is 6", "answer": "42"}
TOO_LONG = {"prompt": "z" * 30, "answer": "1"}
MAX_PROMPT_LEN = 20


def write_jsonl(path, rows):
    path.write_bytes(b"".join((json.dumps(r).encode() if isinstance(r, dict) else r) + b"\n"
                              for r in rows))  # fmt: skip
    return path


def dataset(source, template=PASS_THROUGH, **kw):
    kw = {"max_prompt_len": MAX_PROMPT_LEN, "seed": 0, "num_epochs": None, **kw}
    return prompt_dataset(source, TOK, template, **kw)


@pytest.fixture
def read_budget(monkeypatch):
    """Makes reading more than 100 rows fail, so a pipeline that skips forever fails the test
    instead of hanging it (grain hands the reader's error to the consumer)."""
    read, reads = RowSource.__getitem__, itertools.count()

    def bounded_read(self, index):
        if next(reads) >= 100:
            raise RuntimeError("read more than 100 rows: the pipeline skips bad rows forever")
        return read(self, index)

    monkeypatch.setattr(RowSource, "__getitem__", bounded_read)


def test_empty_prompt_is_skipped_and_counted_under_its_own_reason(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "", "answer": "1"}])
    it = iter(dataset(open_files([path], ["prompt", "answer"]), num_epochs=1))
    assert [r["row"] for r in it] == [0]
    assert it.skipped == {"empty_prompt": 1}


def test_empty_prompt_under_error_mode_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "", "answer": "1"}])
    ds = dataset(open_files([path], ["prompt", "answer"]), num_epochs=1, on_bad_row="error")
    with pytest.raises(BadRowError, match=f"{path} line 2 field 'prompt'.*empty"):
        list(ds)


def test_empty_prompt_is_usable_when_the_template_adds_tokens():
    # The rule is about tokens the engine receives, not about the raw field being empty.
    records = list(dataset(memory_rows([{"prompt": "", "answer": "1"}]),
                           template=FormatTemplate("q: {prompt} ?"), num_epochs=1))  # fmt: skip
    assert [TOK.decode(r["prompt_tokens"]) for r in records] == ["q:  ?"]


@pytest.mark.parametrize("num_epochs", [None, 1, 3])
@pytest.mark.parametrize(
    "rows,reason",
    [([b"{not json"] * 4, "invalid_json"), ([TOO_LONG] * 4, "prompt_too_long"),
     ([{"prompt": "", "answer": "1"}] * 4, "empty_prompt")],
)  # fmt: skip
def test_data_without_a_usable_row_stops_after_one_pass(tmp_path, read_budget, num_epochs,
                                                        rows, reason):  # fmt: skip
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    it = iter(dataset(open_files([path], ["prompt", "answer"]), num_epochs=num_epochs))
    with pytest.raises(NoUsableRowsError, match=re.escape(f"4 rows of data files ['{path}']")):
        next(it)
    assert it.skipped == {reason: 4}  # exactly one pass was read, not more


def test_the_error_counts_every_reason_and_names_every_file(tmp_path, read_budget):
    a = write_jsonl(tmp_path / "a.jsonl", [b"{not json", TOO_LONG])
    b = write_jsonl(
        tmp_path / "b.jsonl", [b"{not json", {"answer": "1"}, {"prompt": 5, "answer": "1"}]
    )
    it = iter(dataset(open_files([a, b], ["prompt", "answer"])))
    with pytest.raises(NoUsableRowsError) as error:
        next(it)
    message = str(error.value)
    assert f"['{a}', '{b}']" in message
    assert "invalid_json=2, missing_field=1, prompt_too_long=1, wrong_type=1" in message


def test_one_usable_row_among_many_bad_ones_keeps_flowing_every_epoch():
    # Runs of bad rows that span an epoch boundary are longer than an epoch, yet each epoch
    # still holds the good row: only a whole epoch without one may stop the run.
    rows = [GOOD] + [{"prompt": 5, "answer": "1"}] * 3
    records = list(itertools.islice(dataset(memory_rows(rows), seed=1), 20))
    assert [r["prompt_id"] for r in records] == [4 * epoch for epoch in range(20)]


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_resume_mid_epoch_neither_stops_nor_changes_the_stream(cut):
    rows = [GOOD] + [{"prompt": 5, "answer": "1"}] * 3
    ds = dataset(memory_rows(rows), seed=2)
    full = [r["prompt_id"] for r in itertools.islice(ds, 8)]
    it = iter(ds)
    head = [r["prompt_id"] for r in itertools.islice(it, cut)]
    resumed = iter(ds)
    resumed.set_state(json.loads(json.dumps(it.get_state())))  # what a checkpoint stores
    tail = [r["prompt_id"] for r in itertools.islice(resumed, 8 - cut)]
    assert head + tail == full == [4 * epoch for epoch in range(8)]
