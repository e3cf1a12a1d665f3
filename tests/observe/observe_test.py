"""Metrics, trace and plot outputs, read back independently of the code that wrote them."""

from __future__ import annotations

import glob
import json
import math
import pathlib
import struct

from tensorboardX.proto import event_pb2

from dora_jax.observe import metrics_lib, plots_lib, progress_lib, trace_lib


def _read_tensorboard_scalars(workdir: str) -> dict[str, list[tuple[int, float]]]:
    """Parses TFRecord framing (length, crc, payload, crc) of the event files by hand."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in glob.glob(f"{workdir}/events.out.tfevents.*"):
        data = pathlib.Path(path).read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_reach_tensorboard_and_jsonl(tmp_path):
    writer = metrics_lib.MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": 0.5, "reward_mean": 0.25, "hist": [1, 2], "bad": float("nan")})
    writer.write(2, {"loss": 0.25, "reward_mean": 0.75})
    writer.close()
    scalars = _read_tensorboard_scalars(str(tmp_path))
    assert scalars["loss"] == [(1, 0.5), (2, 0.25)]
    assert "bad" not in scalars and "hist" not in scalars
    records = metrics_lib.read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["hist"] == [1, 2] and records[0]["bad"] == "nan"


def test_trace_is_valid_chrome_trace_with_named_tracks(tmp_path):
    trace = trace_lib.TraceWriter()
    trace.span("instance 0", "decode v1", 0.0, 10.0, version=1)
    trace.span("trainer", "train", 5.0, 7.0)
    trace.span("instance 0", "idle", 10.0, 12.0)
    path = str(tmp_path / "trace.json")
    trace.save(path)
    events = json.loads(pathlib.Path(path).read_text())["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert set(names) == {"instance 0", "trainer"}
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["dur"]) for e in spans] == [
        ("decode v1", names["instance 0"], 10.0),
        ("train", names["trainer"], 2.0),
        ("idle", names["instance 0"], 2.0),
    ]
    assert spans[0]["args"] == {"version": 1}


def test_summary_plot_draws_all_panels(tmp_path):
    records = [
        {
            "step": i,
            "wall_time_s": 2.0 * i,
            "train/reward_mean": math.sin(i),
            "versions_live": 2,
            "train/response_length_mean": 10 + i,
            "slot_occupancy": 0.9,
        }
        for i in range(1, 6)
    ]
    path = str(tmp_path / "summary.png")
    plots_lib.plot_summary(records, path)
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_plot_drops_non_finite_points(tmp_path, monkeypatch):
    # A non-finite metric reaches metrics.jsonl as the string "nan"; plotted as-is it would turn
    # the reward axis categorical.
    records = [
        {"step": 1, "wall_time_s": 1.0, "train/reward_mean": 0.5},
        {"step": 2, "wall_time_s": 2.0, "train/reward_mean": "nan"},
        {"step": 3, "wall_time_s": 3.0, "train/reward_mean": 0.7},
    ]
    figures = []
    monkeypatch.setattr(plots_lib.plt, "close", figures.append)  # keep the figure to inspect
    plots_lib.plot_summary(records, str(tmp_path / "summary.png"))
    (ax,) = [a for a in figures[0].axes if a.get_title() == "reward vs iteration"]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1.0, 3.0] and list(line.get_ydata()) == [0.5, 0.7]
    assert ax.yaxis.get_units() is None  # numeric, not a category axis


def test_held_out_pass_at_1_joins_the_reward_panel(tmp_path, monkeypatch):
    """`eval.every`'s scores, logged with the iteration after the version they score, are
    drawn at that version on the reward-vs-iteration panel."""
    records = [
        {"step": i, "wall_time_s": float(i), "train/reward_mean": 0.1 * i} for i in (1, 2, 3)
    ]
    records[2].update({"eval/version": 2.0, "eval/pass@1": 0.25})
    figures = []
    monkeypatch.setattr(plots_lib.plt, "close", figures.append)
    plots_lib.plot_summary(records, str(tmp_path / "summary.png"), held_out=[(0, 0.1), (3, 0.5)])
    (ax,) = [a for a in figures[0].axes if a.get_title() == "reward vs iteration"]
    held_out = [line for line in ax.get_lines() if line.get_label() == "held-out pass@1"]
    got = [(list(h.get_xdata()), list(h.get_ydata())) for h in held_out]
    assert got == [([0, 2.0, 3], [0.1, 0.25, 0.5])]
    (wall,) = [a for a in figures[0].axes if a.get_title() == "reward vs wall-clock"]
    assert len(wall.get_lines()) == 1  # versions are not wall-clock seconds


def test_progress_line_shows_the_key_fields(capsys):
    display = progress_lib.ProgressDisplay(total=3, live=False)
    display.update(
        1, {"train/reward_mean": 0.5, "train/staleness_max": 2, "trained_tokens_per_s": 1234.4}
    )
    display.update(2, {"train/reward_mean": 0.5, "eval/pass@1": 0.625})
    display.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "iter 1/3" in first and "reward 0.500" in first and "stale 2" in first
    assert "tok/s 1234" in first and "held-out" not in first
    assert "held-out pass@1 0.625" in second


def test_a_resumed_trace_keeps_the_earlier_run_on_one_timeline(tmp_path):
    path = str(tmp_path / "trace.json")
    first = trace_lib.TraceWriter("run")
    first.span("instance 0", "decode v1", first.now_us(), first.now_us() + 5.0)
    first.save(path)
    resumed = trace_lib.TraceWriter("run, resumed at v2", previous=path)
    resumed.span("instance 0", "decode v2", resumed.now_us(), resumed.now_us() + 5.0)
    resumed.save(path)
    events = json.loads(pathlib.Path(path).read_text())["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert process[spans["decode v1"]["pid"]] == "run"
    assert process[spans["decode v2"]["pid"]] == "run, resumed at v2"
    assert spans["decode v2"]["ts"] > spans["decode v1"]["ts"] + 5.0  # after it, on one clock
    tracks = {(e["pid"], e["tid"]) for e in events if e.get("name") == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in spans.values()} <= tracks  # each named in its process
