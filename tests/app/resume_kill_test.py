"""Kill `dora-jax train` with SIGKILL at random points, resume, and lose nothing.

The resumed run must end with the ledger an uninterrupted run writes (byte for byte: the
orchestrator decides from logical events and seeds only), and the audit must pass on it. The
uninterrupted run compiles everything itself (no compilation cache); the killed runs share a
cache that starts cold, so the same bytes also show that a loaded executable changes nothing.
Rewards differ within groups from the first step, so every version is another model and a resume
that decoded or trained with the wrong version's weights would write other tokens.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dora_jax.observe import metrics_lib
from dora_jax.rollout import audit_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    "--config.sft.steps=30",
    "--config.reward.name=app_rewards:even_length",
    "--config.rollout.num_iterations=6",
    "--config.rollout.train_batch_size=16",
    "--config.rollout.rollout_batch_size=32",
    "--config.rollout.group_size=4",
    "--config.engine.slots=8",
    "--config.eval.num_prompts=8",
    "--config.eval.samples_per_prompt=2",
    "--config.checkpoint.every=2",
]


def _start(workdir: pathlib.Path, cache: pathlib.Path | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "dora_jax.cli", "train", "--config=configs/default.py",
               f"--workdir={workdir}", f"--config.compilation_cache_dir={cache or ''}",
               *TINY]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "app")}  # the reward's module
    log = open(workdir.parent / f"{workdir.name}.log", "ab")  # noqa: SIM115
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(workdir: pathlib.Path, cache: pathlib.Path | None) -> None:
    assert _start(workdir, cache).wait(timeout=900) == 0, workdir.parent / f"{workdir.name}.log"


def _checkpoints(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _reward_counters(workdir) -> list[tuple[int, float, float, float]]:
    records = metrics_lib.read_metrics(str(workdir))
    return [
        (r["step"], r["reward/calls"], r["reward/errors"], r["reward/timeouts"]) for r in records
    ]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three full runs and two partial ones
def test_sigkill_at_random_points_then_resume_loses_nothing(tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    _finish(reference, cache=None)
    expected = (reference / "ledger.jsonl").read_bytes()
    assert audit_lib.audit(str(reference)).passed

    cache = tmp_path / "compilation_cache"
    rng = np.random.default_rng(int(os.environ.get("DORA_KILL_SEED", "0")))
    for trial in range(2):
        workdir = tmp_path / f"killed{trial}"
        workdir.mkdir()
        process = _start(workdir, cache)
        deadline = time.time() + 600
        while not _checkpoints(workdir) and process.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 4.0))  # somewhere after the first checkpoint
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert _checkpoints(workdir), "killed before the first checkpoint was written"
        _finish(workdir, cache)
        log = (tmp_path / f"killed{trial}.log").read_text()
        assert "resumed from the checkpoint of version" in log
        report = audit_lib.audit(str(workdir))
        assert report.passed, report.format()
        assert (workdir / "ledger.jsonl").read_bytes() == expected
        # Cumulative counters continue from the checkpoint: per step, as in one straight run.
        assert _reward_counters(workdir) == _reward_counters(reference)
    losses = [r["train/loss"] for r in metrics_lib.read_metrics(str(reference))]
    assert all(loss != 0 for loss in losses), losses  # every step moved the policy
