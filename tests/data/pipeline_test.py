"""The grain prompt pipeline: three file formats, seeded epochs, exact resume, counted bad rows."""

from __future__ import annotations

import itertools
import json
import logging

import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.data import (
    BadRowError,
    FormatTemplate,
    MissingFieldError,
    char_tokenizer,
    memory_rows,
    open_files,
    prompt_dataset,
)
from dora_jax.train.checkpoint_lib import Checkpointer

TOK = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ?:")
TEMPLATE = FormatTemplate("q: {prompt} ?")
ROWS = [{"prompt": f"what is {i}", "answer": str(i * 7)} for i in range(12)]


def write_jsonl(path, rows):
    path.write_bytes(b"".join((json.dumps(r).encode() if isinstance(r, dict) else r) + b"\n"
                              for r in rows))  # fmt: skip
    return path


def write_jsonl_with_bom(path, rows):
    """As Windows tools and pandas' encoding='utf-8-sig' write it."""
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return path


def write_json_array(path, rows):
    """One JSON array, as json.dump(rows) or datasets' to_json(lines=False) write it."""
    path.write_text(json.dumps(rows, indent=1))
    return path


def write_array_record(path, rows):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in rows:
        writer.write(json.dumps(r).encode() if isinstance(r, dict) else r)
    writer.close()
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def dataset(source, **kw):
    kw = {"max_prompt_len": 64, "seed": 0, "num_epochs": 1, **kw}
    return prompt_dataset(source, TOK, TEMPLATE, **kw)


def as_tuples(records):
    return [(r["prompt_id"], r["row"], tuple(r["prompt_tokens"]), r["answer"]) for r in records]


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet"),
                                           (write_array_record, "array_record"),
                                           (write_jsonl_with_bom, "jsonl"),
                                           (write_json_array, "json"),
                                           (write_jsonl, "json")])  # fmt: skip
def test_every_format_yields_each_row_once_tokenized_through_the_template(tmp_path, writer, suffix):
    path = writer(tmp_path / f"d.{suffix}", ROWS)
    records = list(dataset(open_files([path], ["prompt", "answer"])))
    assert sorted(r["row"] for r in records) == list(range(len(ROWS)))
    for r in records:
        row = ROWS[r["row"]]
        assert r["prompt_tokens"].dtype == np.int32
        assert TOK.decode(r["prompt_tokens"]) == f"q: {row['prompt']} ?"
        assert r["answer"] == row["answer"]
    # The order depends on the seed only, not on the file format.
    memory = list(dataset(memory_rows(ROWS)))
    assert as_tuples(records) == as_tuples(memory)


def test_epochs_are_fresh_seeded_permutations_with_unique_prompt_ids():
    n = len(ROWS)
    records = list(dataset(memory_rows(ROWS), num_epochs=3, seed=5))
    assert len(records) == 3 * n
    epochs = [records[e * n : (e + 1) * n] for e in range(3)]
    for e, epoch in enumerate(epochs):
        assert sorted(r["row"] for r in epoch) == list(range(n))
        assert all(r["prompt_id"] == e * n + r["row"] for r in epoch)
    orders = [[r["row"] for r in epoch] for epoch in epochs]
    assert orders[0] != orders[1] and orders[0] != list(range(n))
    again = list(dataset(memory_rows(ROWS), num_epochs=3, seed=5))
    assert as_tuples(again) == as_tuples(records)
    other = list(dataset(memory_rows(ROWS), num_epochs=3, seed=6))
    assert as_tuples(other) != as_tuples(records)


def test_prompt_ids_continue_across_several_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:5])
    b = write_parquet(tmp_path / "b.parquet", ROWS[5:])
    records = list(dataset(open_files([a, b], ["prompt", "answer"])))
    assert {r["row"]: r["answer"] for r in records} == {i: r["answer"] for i, r in enumerate(ROWS)}


@settings(max_examples=8, deadline=None)
@given(cut=st.integers(0, 30), seed=st.integers(0, 3))
def test_resuming_from_a_saved_state_yields_exactly_the_continuation(cut, seed):
    rows = [*ROWS, {"prompt": 3, "answer": "x"}]  # one bad row, so the skip counts are resumed too
    ds = dataset(memory_rows(rows), num_epochs=3, seed=seed)
    full = list(ds)
    it = iter(ds)
    head = list(itertools.islice(it, cut))
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    resumed = iter(ds)
    resumed.set_state(state)
    tail = list(resumed)
    assert as_tuples(head + tail) == as_tuples(full)
    assert resumed.skipped == {"wrong_type": 3}


BAD = [
    (b'{"answer": "1"}', "missing_field", "'prompt'"),
    (b'{"prompt": 5, "answer": "1"}', "wrong_type", "'prompt'"),
    (b'{"prompt": "ok", "answer": [1]}', "wrong_type", "'answer'"),
    (b'{"prompt": "ok", "answer": null}', "missing_field", "'answer'"),
    (b'{"prompt": "\xff\xfe", "answer": "1"}', "undecodable", "'<row>'"),
    (b'{"prompt": "\\ud800", "answer": "1"}', "undecodable", "'prompt'"),
    (b"not json", "invalid_json", "'<row>'"),
    (b"", "invalid_json", "'<row>'"),
    (b"[1, 2]", "wrong_type", "'<row>'"),
    (json.dumps({"prompt": "z" * 60, "answer": "1"}).encode(), "prompt_too_long", "'prompt'"),
]


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"),
                                           (write_array_record, "array_record")])  # fmt: skip
def test_bad_rows_are_skipped_counted_and_logged_with_their_row(tmp_path, caplog, writer, suffix):
    good = [json.dumps(r).encode() for r in ROWS[:3]]
    path = writer(tmp_path / f"d.{suffix}", good + [raw for raw, _, _ in BAD])
    it = iter(dataset(open_files([path], ["prompt", "answer"]), max_prompt_len=40))
    with caplog.at_level(logging.WARNING):
        records = list(it)
    assert sorted(r["row"] for r in records) == [0, 1, 2]
    expected: dict[str, int] = {}
    for _, reason, _ in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert it.skipped == expected
    # A JSONL row is named by its line, as an editor shows the file (rows 3.. are lines 4..);
    # a record file's by its record number from 0.
    for row, (_, _, field) in enumerate(BAD, start=3):
        position = f"line {row + 1}" if suffix == "jsonl" else f"row {row} (from 0)"
        assert any(f"{path} {position} field {field}" in m for m in caplog.messages)
    assert any("is a blank line" in m for m in caplog.messages)


@pytest.mark.parametrize("raw,reason,field", BAD)
def test_error_mode_stops_naming_file_row_and_field(tmp_path, raw, reason, field):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]).encode(), raw])
    ds = dataset(open_files([path], ["prompt", "answer"]), max_prompt_len=40, on_bad_row="error")
    with pytest.raises(BadRowError, match=f"{path} line 2 field {field}"):
        list(ds)


def test_parquet_nulls_missing_columns_and_binary_text(tmp_path):
    nulls = write_parquet(tmp_path / "a.parquet", [{"prompt": "ok", "answer": "1"},
                                                   {"prompt": None, "answer": "2"}])  # fmt: skip
    no_answer = write_parquet(tmp_path / "b.parquet", [{"prompt": "ok"}])
    binary = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt": pa.array([b"ok", b"\xff"], pa.binary()),
                             "answer": ["1", "2"]}), binary)  # fmt: skip
    it = iter(dataset(open_files([nulls, binary], ["prompt", "answer"])))
    assert sorted(r["row"] for r in it) == [0, 2]
    assert it.skipped == {"missing_field": 1, "undecodable": 1}
    # A column no row can have: the field's name is wrong, refused when the file is opened.
    with pytest.raises(MissingFieldError, match=r"b\.parquet has no column 'answer' \(its col"):
        open_files([nulls, no_answer], ["prompt", "answer"])
    # A table's rows are named from 0, as pandas' iloc counts them.
    ds = dataset(open_files([nulls], ["prompt", "answer"]), num_epochs=1, on_bad_row="error")
    with pytest.raises(BadRowError, match=rf"{nulls} row 1 \(from 0\) field 'prompt'"):
        list(ds)


def test_custom_field_names_and_numeric_answers(tmp_path):
    rows = [{"question": "what is 6", "solution": s} for s in (42, 4.0, 2.5, -0.0, 1e300)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = dataset(open_files([path], ["question", "solution"]), prompt_field="question",
                 answer_field="solution")  # fmt: skip
    # A whole number is written as the model writes it, whatever type the file gave it.
    answers = [answer for _, answer in sorted((r["row"], r["answer"]) for r in ds)]
    assert answers == ["42", "4", "2.5", "0", str(int(1e300))]
    # The default names, on a file whose rows have others: refused when it is opened, not row
    # by row through a whole pass.
    with pytest.raises(MissingFieldError) as refused:
        open_files([path], ["prompt", "answer"])
    assert refused.value.field == "prompt"
    assert str(refused.value) == (
        f"data file {path}: none of its first 5 rows has a field 'prompt' "
        "(they have ['question', 'solution'])"
    )


def test_a_few_bad_rows_at_the_top_of_a_file_do_not_refuse_it(tmp_path):
    """Only a field that no row of a file's top has is a wrong name: bad rows there, missing
    the field or not JSON, are left to `on_bad_row`."""
    path = write_jsonl(tmp_path / "d.jsonl", [b"not json", b'{"answer": "1"}',
                                              *(json.dumps(r).encode() for r in ROWS)])  # fmt: skip
    it = iter(dataset(open_files([path], ["prompt", "answer"])))
    assert len(list(it)) == len(ROWS) and it.skipped == {"invalid_json": 1, "missing_field": 1}


def test_configuration_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="on_bad_row"):
        dataset(memory_rows(ROWS), on_bad_row="ignore")
    with pytest.raises(ValueError, match="max_prompt_len"):
        dataset(memory_rows(ROWS), max_prompt_len=0)
    with pytest.raises(ValueError, match="num_epochs"):
        dataset(memory_rows(ROWS), num_epochs=0)
    with pytest.raises(ValueError, match="unknown format"):
        open_files([write_jsonl(tmp_path / "d.csv", ROWS)], ["prompt"])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        open_files([tmp_path / "missing.jsonl"], ["prompt"])
    with pytest.raises(ValueError, match="no rows"):
        open_files([write_jsonl(tmp_path / "empty.jsonl", [])], ["prompt"])
    (tmp_path / "empty.array_record").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.array_record: not a readable ArrayRecord"):
        open_files([tmp_path / "empty.array_record"], ["prompt"])


def test_iterator_state_survives_the_orbax_checkpointer(tmp_path):
    ds = dataset(memory_rows([*ROWS, {"prompt": 1, "answer": "x"}]), num_epochs=2, seed=3)
    full = list(ds)
    it = iter(ds)
    head = list(itertools.islice(it, 7))
    params = {"w": jnp.zeros(2)}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    state = {"params": params, "opt_state": {"m": jnp.ones(2)}}
    ckpt.save(1, train_state=state, data_iterator=it, meta={})
    resumed = iter(ds)
    ckpt.restore(1, train_state_like=state, data_iterator=resumed)
    ckpt.close()
    assert resumed.skipped == it.skipped
    assert as_tuples(head + list(resumed)) == as_tuples(full)
