"""Random-access row sources over JSONL, Parquet and ArrayRecord files (and in-memory rows).

grain shuffles and checkpoints by *index*, so every source is a sequence: `len()` and
`source[i]`. Each element is a `Row` that remembers where it came from (file and row number), so
a malformed row can be reported precisely, and a global index that is stable for a given file
list, from which prompt ids are made. Rows are returned unparsed (raw bytes or a dict): parsing
and validation happen in the pipeline, where a bad row is counted or reported instead of
crashing a reader thread.

Formats:
  * `.jsonl` / `.json` - one JSON object per line; every line is a row (a blank line is a bad
    row, so row numbers equal line numbers - 1); a leading UTF-8 byte-order mark is skipped.
    A `.json` file that is one JSON array gives its elements as rows.
  * `.parquet` - one row per table row; only the prompt and answer columns are read.
  * `.array_record` / `.arrayrecord` - one UTF-8 JSON object per record.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import pyarrow.parquet as pq


@dataclasses.dataclass(frozen=True)
class Row:
    index: int  # global index over all files of the source, in file order
    file: str
    row: int  # row number within `file`, 0-based
    payload: Any  # bytes (JSONL, ArrayRecord) or dict (Parquet, memory)
    is_line: bool = False  # a JSONL line, so `position` gives its (1-based) line number

    @property
    def position(self) -> str:
        """Where the row is in its file, as the user's tools count: an editor's line number, or
        a table's row number from 0 (pandas' `iloc`)."""
        return f"line {self.row + 1}" if self.is_line else f"row {self.row} (from 0)"


_BOM = b"\xef\xbb\xbf"


class _JsonlReader:
    """Byte offsets of every line, found in one pass; rows are read with `pread` (thread-safe)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDONLY)
        with open(path, "rb") as f:
            # A UTF-8 byte-order mark (Windows tools, encoding='utf-8-sig') is not the first
            # row's: left in, it made that row invalid JSON.
            self._offsets = [len(_BOM) if f.read(len(_BOM)) == _BOM else 0]
            f.seek(self._offsets[0])
            for line in f:
                self._offsets.append(self._offsets[-1] + len(line))
        # A final newline ends the last row; it does not start an empty one.

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        start, end = self._offsets[i], self._offsets[i + 1]
        return os.pread(self._fd, end - start, start).rstrip(b"\r\n")


class MissingFieldError(ValueError):
    """A data file where no row has a field the run reads: the field's name is wrong, not the
    rows (bad rows are the pipeline's, skipped or not by `on_bad_row`). `field` is the name."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


# The rows of a JSON file looked at for the fields the run reads: enough that a few bad rows at
# its top do not refuse a file, few enough to cost nothing.
_ROWS_CHECKED = 16


class _ParquetReader:
    """The needed columns as Python lists; a null leaves the field absent."""

    def __init__(self, path: str, fields: Sequence[str]):
        names = pq.read_schema(path).names
        for field in fields:
            if field not in names:
                raise MissingFieldError(
                    f"data file {path} has no column {field!r} (its columns: {names})", field
                )
        table = pq.read_table(path, columns=list(fields))
        self._columns = {f: table.column(f).to_pylist() for f in fields}
        self._len = table.num_rows

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict:
        return {f: col[i] for f, col in self._columns.items() if col[i] is not None}


class RowSource:
    """Concatenation of per-file readers, indexed globally."""

    def __init__(self, files: Sequence[tuple[str, Sequence[Any]]]):
        self._names = [name for name, _ in files]
        self._readers = [reader for _, reader in files]
        self._starts = [0]
        for reader in self._readers:
            self._starts.append(self._starts[-1] + len(reader))
        if self._starts[-1] == 0:
            raise ValueError(f"data files {self._names} hold no rows")

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def files(self) -> tuple[str, ...]:
        """The file names, in order (what an error about the whole source names)."""
        return tuple(self._names)

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(index)
        f = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[f]
        reader = self._readers[f]
        return Row(index, self._names[f], local, reader[local], isinstance(reader, _JsonlReader))


def file_list(value: str) -> list[str]:
    """The paths of a config's comma-separated file list (`data.train_files`), spaces around
    each dropped."""
    return [p.strip() for p in value.split(",") if p.strip()]


def open_files(paths: Sequence[str | Path], fields: Sequence[str]) -> RowSource:
    """Opens data files by extension; `fields` are the columns Parquet needs to read."""
    if not paths:
        raise ValueError("data files: the list is empty")
    missing = [str(p) for p in paths if not os.path.isfile(p)]
    if missing:  # all of them at once: a run is refused for them at start
        raise FileNotFoundError("; ".join(f"data file {p} does not exist" for p in missing))
    files = []
    for path in map(str, paths):
        suffix = Path(path).suffix.lower()
        if suffix == ".json" and _is_json_array(path):
            reader = _json_array(path)
        elif suffix in (".jsonl", ".json"):
            reader = _JsonlReader(path)
        elif suffix == ".parquet":
            reader = _ParquetReader(path, fields)
        elif suffix in (".array_record", ".arrayrecord"):
            try:
                reader = grain.sources.ArrayRecordDataSource([path])
            except RuntimeError as e:  # its reader's word for a file it cannot read
                raise ValueError(f"data file {path}: not a readable ArrayRecord file ({e})") from e
        else:
            raise ValueError(
                f"data file {path}: unknown format {suffix!r} "
                "(expected .jsonl, .json, .parquet or .array_record)"
            )
        if suffix != ".parquet":
            _check_fields(path, reader, fields)
        files.append((path, reader))
    return RowSource(files)


def _check_fields(path: str, reader: Sequence[Any], fields: Sequence[str]) -> None:
    """Refuses a file whose first rows that are JSON objects all lack one of `fields`: a
    misspelled `data.prompt_field` made every row a bad row, skipped one warning at a time
    through a whole pass before the run stopped."""
    objects = []
    for i in range(min(len(reader), _ROWS_CHECKED)):
        row = reader[i]
        try:
            row = json.loads(row) if isinstance(row, bytes | str) else row
        except ValueError:  # a bad row: the pipeline's to judge
            continue
        if isinstance(row, dict):
            objects.append(row)
    for field in fields:
        if objects and not any(field in row for row in objects):
            present = sorted({key for row in objects for key in row})
            raise MissingFieldError(
                f"data file {path}: none of its first {len(objects)} rows has a field "
                f"{field!r} (they have {present})",
                field,
            )


def _is_json_array(path: str) -> bool:
    """Whether a .json file is one JSON array (json.dump of a list, datasets' `to_json` with
    lines=False) rather than JSON lines: read as lines, each of its lines was a bad row."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(_BOM).lstrip()
    return head.startswith(b"[")


def _json_array(path: str) -> list[Any]:
    """The array's elements as rows (a non-object element is a bad row, like any other)."""
    with open(path, encoding="utf-8-sig") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {path}: not a valid JSON array ({e})") from e
    if not isinstance(rows, list):
        raise ValueError(f"data file {path}: a .json file must hold one array or JSON lines")
    return rows


def memory_rows(rows: Sequence[dict], name: str = "<memory>") -> RowSource:
    """Rows held in memory (the built-in task), read through the same pipeline as files."""
    return RowSource([(name, list(rows))])
