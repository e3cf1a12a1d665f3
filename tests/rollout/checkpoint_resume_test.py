"""Resume from a checkpoint barrier: nothing lost, nothing twice, the same ledger.

The uninterrupted run checkpoints every few versions; a second run starts from one of those
states with a ledger that also holds events written after it (as a crash would leave it). Both
must end with byte-identical ledgers, and the audit recomputes C1-C3 from the resumed one.
"""

from __future__ import annotations

import json
import shutil

from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_harness import make_rollout

from dora_jax.rollout import audit_lib


@settings(max_examples=12, deadline=None)
@given(
    mode=st.sampled_from(["sync", "one_step_off", "partial", "dora"]),
    every=st.integers(1, 3),
    pick=st.integers(0, 10),
    slots=st.integers(2, 5),
    steps_per_turn=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_resumed_run_writes_the_uninterrupted_ledger(
    tmp_path_factory, mode, every, pick, slots, steps_per_turn, seed
):
    config = dict(
        mode=mode,
        train_batch_size=8,
        rollout_batch_size=16,
        group_size=4,
        staleness_bound=2,
        num_iterations=6,
        timer_steps=3,
        publish_delay_steps=2,
        decode_steps_per_turn=steps_per_turn,
        seed=seed,
        slots=slots,
    )
    full = tmp_path_factory.mktemp("full")
    states: list[dict] = []
    rollout, _, _ = make_rollout(
        str(full),
        checkpoint_every=every,
        on_checkpoint=lambda s: states.append(json.loads(json.dumps(s))),
        **config,
    )
    rollout.run()
    assert [s["newest"] for s in states] == sorted({*range(every, 6, every), 6})  # and the last
    state = states[pick % len(states)]

    resumed = tmp_path_factory.mktemp("resumed")
    # What a crash leaves behind: the events written after the checkpoint, and a torn line.
    shutil.copy(full / "ledger.jsonl", resumed / "ledger.jsonl")
    shutil.copy(full / "trace.json", resumed / "trace.json")
    with open(resumed / "ledger.jsonl", "a") as f:
        f.write('{"event": "dispatch", "prompt_id": 99')
    rollout, trainer, _ = make_rollout(str(resumed), checkpoint_every=every, resume=state, **config)
    rollout.run()
    assert (resumed / "ledger.jsonl").read_bytes() == (full / "ledger.jsonl").read_bytes()
    # The trace keeps the run before the restart, as a process of its own.
    events = json.loads((resumed / "trace.json").read_text())["traceEvents"]
    processes = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    resumed_at = f"dora_jax rollout ({mode}), resumed at v{state['newest']}"
    assert processes == [f"dora_jax rollout ({mode})", resumed_at]
    assert trainer.version == 6
    report = audit_lib.audit(str(resumed))
    assert report.rules["C2"] and report.rules["C3"]
    assert report.trained == 6 * 8


def test_the_trace_up_to_each_barrier_survives_a_kill(tmp_path):
    """A SIGKILLed run never reaches its stop, where the trace is written: its timeline was
    lost, and the resumed run's trace began at the restart."""
    traced: list[list[str]] = []

    def on_checkpoint(state):
        events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        traced.append([e["name"] for e in events if e.get("ph") == "X"])

    rollout, _, _ = make_rollout(
        str(tmp_path), mode="dora", train_batch_size=8, rollout_batch_size=16, group_size=4,
        staleness_bound=2, num_iterations=4, checkpoint_every=2, on_checkpoint=on_checkpoint,
    )  # fmt: skip
    rollout.run()
    assert len(traced) == 2 and "decode v0" in traced[0] and len(traced[1]) > len(traced[0])
