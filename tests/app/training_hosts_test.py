"""`dora-jax train` with training hosts: the training mesh across two processes (this one and a
child, `jax.distributed` over gloo) trains what one process trains on the same mesh shape.

The reference runs in this process on 4 of its 8 devices (fsdp 2 x tp 2); the group run is a
CLI process of 2 devices joined by a child training host of 2, the same mesh shape. Their
ledgers must match byte for byte: the SFT warm-up, every RL update and every published version
went through the group, and the sampled tokens depend on all of them. (The group's all-reduce
sums in another order than one process's, so params agree to ~1e-8, not bit for bit: the
comparison holds because no sampled token sits that close to a tie in this run.) Then the group
run resumes from its checkpoint and must end with the same ledger again.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

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


def _group_run(workdir: pathlib.Path) -> str:
    command = [sys.executable, "-m", "dora_jax.cli", "train", "--config=configs/default.py",
               f"--workdir={workdir}", "--config.num_cpu_devices=2",
               "--config.runtime.training_hosts=local:1",
               *(f"--config.{k}={v}" for k, v in SMALL.items())]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # 2 devices per process
    env["PYTHONPATH"] = str(ROOT / "tests" / "app")  # the reward's module
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


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

    group = tmp_path / "group"
    _group_run(group)
    assert (group / "ledger.jsonl").read_bytes() == expected
    assert audit_lib.audit(str(group)).passed
    assert (group / "hf_policy" / "model.safetensors").exists()

    # Resume from the checkpoint of version 2 (the controller saved it from host arrays; the
    # group restores it onto the mesh across both processes).
    for step in (group / "checkpoints").iterdir():
        if step.name.isdigit() and int(step.name) > 2:
            shutil.rmtree(step)
    log = _group_run(group)
    assert "resumed from the checkpoint of version 2" in log
    assert (group / "ledger.jsonl").read_bytes() == expected
