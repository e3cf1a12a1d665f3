"""A resumed run's metrics: TensorBoard and metrics.jsonl hold each step once, the redone
steps with the resumed run's values, read back as TensorBoard reads event files."""

from __future__ import annotations

import glob
import pathlib
import struct
import time

import pytest
from tensorboardX.proto import event_pb2

from dora_jax.observe import metrics_lib


def _events(path: str) -> list[event_pb2.Event]:
    data, offset, events = pathlib.Path(path).read_bytes(), 0, []
    while offset < len(data):  # TFRecord framing: length, crc, payload, crc
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        events.append(event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length]))
        offset += 12 + length + 4
    return events


def _as_tensorboard_shows(workdir: str, tag: str) -> list[tuple[int, float]]:
    """The files in the order they were written; a session START at step s discards the
    points at step >= s read before it (TensorBoard's purge of orphaned steps)."""
    files = sorted((_events(p) for p in glob.glob(f"{workdir}/events.out.tfevents.*")),
                   key=lambda events: events[0].wall_time)  # fmt: skip
    points: list[tuple[int, float]] = []
    for event in (e for events in files for e in events):
        if event.HasField("session_log") and event.session_log.status == event.session_log.START:
            points = [p for p in points if p[0] < event.step]
        points += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return points


def test_a_resumed_run_redoes_its_steps_once_in_tensorboard_and_jsonl(tmp_path):
    first = metrics_lib.MetricsWriter(str(tmp_path))
    for step in (1, 2):
        first.write(step, {"loss": float(step)})
    offset = first.offset()  # a checkpoint at step 2
    for step in (3, 4):  # then the run dies
        first.write(step, {"loss": float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they start in, as a real restart's
    resumed = metrics_lib.MetricsWriter(str(tmp_path), offset, first_step=3)
    for step in (3, 4, 5):
        resumed.write(step, {"loss": 10.0 * step})
    resumed.close()
    expected = [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert _as_tensorboard_shows(str(tmp_path), "loss") == expected
    records = metrics_lib.read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in records] == expected


def test_a_metrics_file_shorter_than_its_checkpoint_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="fewer than the 500 its checkpoint recorded"):
        metrics_lib.MetricsWriter(str(tmp_path), 500, first_step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # not padded with NULs
