"""`dora-jax train` with training hosts: the training mesh across two processes (this one and a
child, `jax.distributed` over gloo) trains what one process trains on the same mesh shape.

The reference runs in this process on 4 of its 8 devices (fsdp 2 x tp 2); the group run is a
CLI process of 2 devices joined by a child training host of 2, the same mesh shape. Their
ledgers must match byte for byte: the SFT warm-up, every RL update and every published version
went through the group, and the sampled tokens depend on all of them. (The group's all-reduce
sums in another order than one process's, so params agree to ~1e-8, not bit for bit: the
comparison holds because no sampled token sits that close to a tie in this run.) The group run
loses its training host midway and resumes from its checkpoint: nothing may be lost.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from configs import default
from dora_jax import app_lib
from dora_jax.observe import metrics_lib
from dora_jax.rollout import audit_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = {
    "sft.steps": 20,
    "reward.name": "app_rewards:even_length",  # rewards that differ within groups from the start
    "rollout.num_iterations": 4,
    "rollout.train_batch_size": 16,
    "rollout.rollout_batch_size": 32,
    "rollout.group_size": 4,
    "engine.slots": 8,
    "eval.num_prompts": 4,
    "eval.samples_per_prompt": 1,
    "checkpoint.every": 2,
    "runtime.generation_hosts": "local",
    "runtime.num_instances": 2,
    "runtime.train_devices": 4,
    "runtime.train_tp": 2,
}


def _group_run(workdir: pathlib.Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "dora_jax.cli", "train", "--config=configs/default.py",
               f"--workdir={workdir}", "--config.num_cpu_devices=2",
               "--config.runtime.training_hosts=local:1",
               *(f"--config.{k}={v}" for k, v in SMALL.items())]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env["PYTHONPATH"] = str(ROOT / "tests" / "app")  # the reward's module
    log = open(workdir.parent / f"{workdir.name}.log", "a")  # noqa: SIM115
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _training_host(controller: int) -> int:
    """The controller's first child started by `multiprocessing` spawn: the training host,
    which it starts before anything else (the generation hosts come later)."""
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == controller and b"spawn_main" in cmdline:
            children.append(int(stat.parent.name))
    assert children, "no training host found"
    return min(children)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three runs
def test_training_group_writes_the_ledger_of_one_process_and_resumes(tmp_path):
    config = default.get_config()
    for key, value in SMALL.items():
        section, field = key.split(".")
        config[section][field] = value
    reference = tmp_path / "reference"
    summary = app_lib.train_and_evaluate(config, str(reference), progress=False)
    assert summary["rollout_totals"]["trained"] == 4 * 16
    losses = [r["train/loss"] for r in metrics_lib.read_metrics(str(reference))]
    assert all(loss != 0.0 for loss in losses), losses  # every update moved the policy
    expected = (reference / "ledger.jsonl").read_bytes()

    # The training host dies once the checkpoint of version 2 is written: the controller must
    # stop at once, naming the cause, rather than wait in a collective for the dead host.
    group = tmp_path / "group"
    group.mkdir()
    controller = _group_run(group)
    deadline = time.time() + 900
    while not (group / "checkpoints" / "2").exists() and time.time() < deadline:
        assert controller.poll() is None, (tmp_path / "group.log").read_text()[-3000:]
        time.sleep(0.1)
    os.kill(_training_host(controller.pid), signal.SIGKILL)
    killed_at = time.time()
    assert controller.wait(timeout=60) == 1
    assert time.time() - killed_at < 30  # JAX's own heartbeat timeout is 100 s
    assert "training host 1 ended" in (tmp_path / "group.log").read_text()

    # The resumed run restores the checkpoint (saved by the controller from host arrays) onto
    # the mesh across both processes and ends with the one-process ledger.
    assert _group_run(group).wait(timeout=900) == 0, (tmp_path / "group.log").read_text()[-3000:]
    log = (tmp_path / "group.log").read_text()
    assert "resumed from the checkpoint of version 2" in log
    assert (group / "ledger.jsonl").read_bytes() == expected
    assert audit_lib.audit(str(group)).passed
    assert (group / "hf_policy" / "model.safetensors").exists()
