"""`dora-jax bench`: every rollout paradigm on one seeded long-tail workload, side by side.

Same model initialisation, same prompts, same forced response lengths (EOS ignored until each
request's drawn length), same trainer: only the scheduling differs, so the ratios between modes
are what the paradigm buys. The first `warmup_iterations` of each mode pay XLA compilation and
are left out of the throughput figures; the ledgers and traces of every mode stay under
`WORKDIR/<mode>/` for the audit and Perfetto.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections
import numpy as np

from dora_jax import models
from dora_jax.engine import Engine
from dora_jax.rollout import audit_lib, request_lib
from dora_jax.rollout.config_lib import RolloutConfig
from dora_jax.rollout.runner_lib import Rollout
from dora_jax.runtime.devices_lib import plan_devices
from dora_jax.train import TrainConfig, Trainer

REPORTED = ("trained_tokens_per_s", "rollout_time_s", "step_time_s", "bubble_fraction",
            "slot_occupancy")  # fmt: skip


def _parity_reward(prompt_id: int, tokens: np.ndarray) -> float:
    """A cheap deterministic reward with both outcomes in every group, so updates are real."""
    return float((int(tokens.sum()) + prompt_id) % 2)


def run_mode(config: ml_collections.ConfigDict, mode: str, workdir: str) -> dict[str, float]:
    """One paradigm on the workload; returns the figures of `REPORTED` plus the audit verdict."""
    plan = plan_devices(
        train_devices=config.runtime.train_devices,
        num_instances=config.runtime.num_instances,
        devices_per_instance=config.runtime.devices_per_instance,
        train_tp=config.runtime.train_tp,
    )
    model = models.create(models.ModelConfig(**config.model.to_dict()), seed=config.seed)
    rollout_config = RolloutConfig.from_dict(
        {**config.rollout.to_dict(), "mode": mode, "seed": config.seed}
    )
    w = config.workload
    engines = [
        Engine(
            model,
            max_concurrent_decodes=config.engine.slots,
            # partial re-prefills prompt + generated-so-far after every weight update.
            max_prefill_length=w.prompt_length + (w.max_length if mode == "partial" else 0),
            max_decode_length=w.max_length,
            mesh=mesh,
        )
        for mesh in plan.generation_meshes
    ]
    trainer = Trainer(
        model,
        TrainConfig.from_config(
            {
                **config.train.to_dict(),
                "tbs": rollout_config.train_batch_size,
                "group_size": rollout_config.group_size,
            }
        ),
        plan.train_mesh,
    )
    prompts = request_lib.heavy_tail_prompts(
        seed=config.seed,
        group_size=rollout_config.group_size,
        vocab_size=config.model.vocab_size,
        prompt_length=w.prompt_length,
        median_length=w.median_length,
        max_length=w.max_length,
        sigma=w.sigma,
    )
    os.makedirs(workdir, exist_ok=True)
    history = Rollout(rollout_config, engines, trainer, prompts, _parity_reward, workdir).run()
    measured = history[config.warmup_iterations :] or history
    seconds = sum(m["iteration_time_s"] for m in measured)
    return {
        "trained_tokens_per_s": sum(m["trained_tokens"] for m in measured) / seconds,
        "rollout_time_s": sum(m["rollout_time_s"] for m in measured),
        "step_time_s": float(np.mean([m["step_time_s"] for m in measured])),
        "bubble_fraction": float(np.mean([m["bubble_fraction"] for m in measured])),
        "slot_occupancy": float(np.mean([m["slot_occupancy"] for m in measured])),
        "measured_seconds": seconds,
        "audit_passed": audit_lib.audit(workdir).passed,
    }


def run_bench(config: ml_collections.ConfigDict, workdir: str) -> dict[str, dict[str, float]]:
    """Runs every mode of `config.modes`, prints the table, writes `WORKDIR/bench.json`."""
    results = {}
    for mode in config.modes.split(","):
        results[mode] = run_mode(config, mode, os.path.join(workdir, mode))
        print(f"{mode}: {results[mode]}", flush=True)
    with open(os.path.join(workdir, "bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(format_table(results))
    return results


def format_table(results: dict[str, dict[str, Any]]) -> str:
    baseline = results.get("sync", {}).get("trained_tokens_per_s")
    header = f"{'mode':<14}" + "".join(f"{k:>22}" for k in REPORTED) + f"{'vs sync':>10}"
    lines = [header]
    for mode, r in results.items():
        ratio = r["trained_tokens_per_s"] / baseline if baseline else float("nan")
        lines.append(
            f"{mode:<14}" + "".join(f"{r[k]:>22.3f}" for k in REPORTED) + f"{ratio:>9.2f}x"
        )
    return "\n".join(lines)
