"""`dora-jax bench`: every rollout paradigm on one seeded long-tail workload, side by side.

Same model initialisation, same prompts, same forced response lengths (EOS ignored until each
request's drawn length), same trainer: only the scheduling differs, so the ratios between modes
are what the paradigm buys. The first `warmup_iterations` of each mode pay XLA compilation and
are left out of the throughput figures; the ledgers and traces of every mode stay under
`WORKDIR/<mode>/` for the audit and Perfetto.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from dora_jax import models
from dora_jax.engine import Engine
from dora_jax.engine.request_lib import Request as EngineRequest
from dora_jax.rollout import audit_lib, request_lib
from dora_jax.rollout.config_lib import RolloutConfig, train_config
from dora_jax.rollout.runner_lib import Rollout
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.runtime.devices_lib import plan_devices
from dora_jax.train import Trainer

REPORTED = ("trained_tokens_per_s", "rollout_time_s", "step_time_s", "bubble_fraction",
            "slot_occupancy")  # fmt: skip


def _parity_reward(prompt_id: int, tokens: np.ndarray) -> float:
    """A cheap deterministic reward with both outcomes in every group, so updates are real."""
    return float((int(tokens.sum()) + prompt_id) % 2)


class FinitePrompts:
    """The first `num_prompts` prompts of a source, as a finite workload: every paradigm gets
    exactly these groups and trains all of them (see `paradigms_lib.prompts_left`)."""

    def __init__(self, source: request_lib.PromptSource, num_prompts: int):
        self.source = source
        self.num_prompts = num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    def __call__(self, prompt_id: int) -> request_lib.PromptSpec:
        if not 0 <= prompt_id < self.num_prompts:
            raise IndexError(f"prompt {prompt_id} is outside the workload of {self.num_prompts}")
        return self.source(prompt_id)


def workload(config: ml_collections.ConfigDict, seed: int, iterations: int) -> FinitePrompts:
    """`iterations` batches' worth of heavy-tailed prompts (TBS / G groups per batch)."""
    w, r = config.workload, config.rollout
    source = request_lib.heavy_tail_prompts(
        seed=seed,
        group_size=r.group_size,
        vocab_size=config.model.vocab_size,
        prompt_length=w.prompt_length,
        median_length=w.median_length,
        max_length=w.max_length,
        sigma=w.sigma,
    )
    return FinitePrompts(source, iterations * (r.train_batch_size // r.group_size))


def precompile(engines: list[Engine], trainer: Trainer, config: ml_collections.ConfigDict):
    """Compiles what a short warm-up run may miss: every prefill bucket and batch size of every
    engine (admission prefills a turn's requests together; the partial paradigm re-prefills
    prompt + generated tokens, any length) and a training step per length bucket. The caller
    restores the trainer's state afterwards."""
    for engine in engines:
        params = engine.load_params()
        sizes = [1 << i for i in range((engine.max_concurrent_decodes - 1).bit_length() + 1)]
        for bucket in engine.prefill_buckets:
            tokens = np.ones(bucket, np.int32)
            request = EngineRequest(
                prompt_tokens=tokens, max_new_tokens=2, ignore_eos=True, seed=0, id=(-1, 0)
            )
            for n in sizes:
                prefix, _ = engine.prefill_requests(params, [request] * n)
                state = engine.insert(prefix, engine.init_decode_state(), list(range(n)))
                jax.block_until_ready(engine.free_slot(state, list(range(n))))
        # The slot moves a run may first need mid-measurement: insert, decode, a migration
        # (export + import), free.
        state = engine.insert(prefix, engine.init_decode_state(), 0)
        state, result = engine.generate(params, state)
        result.convert_to_numpy()
        exported = engine.export_slot(state, 0)
        state = engine.free_slot(state, 0)
        state = engine.import_slot(state, 1, exported)
        jax.block_until_ready(engine.free_slot(state, 1))
    r, w = config.rollout, config.workload
    longest = w.prompt_length + w.max_length
    for bucket in config.train.length_buckets:
        n = min(bucket, longest) - w.prompt_length
        if n < 1:
            continue
        batch = [
            Trajectory(
                prompt_id=i // r.group_size,
                sample_index=i % r.group_size,
                prompt_tokens=np.ones(w.prompt_length, np.int32),
                response_tokens=np.ones(n, np.int32),
                behaviour_logprobs=np.zeros(n, np.float32),
                version=trainer.version,
                token_versions=np.full(n, trainer.version, np.int32),
                reward=float(i % 2),
            )
            for i in range(r.train_batch_size)
        ]
        trainer.step(batch)
        if bucket >= longest:
            break


def run_mode(config: ml_collections.ConfigDict, mode: str, workdir: str) -> dict[str, float]:
    """One paradigm on the workload; returns the figures of `REPORTED` plus the audit verdict.

    The engines and the trainer first run `warmup_iterations` of the same paradigm on another
    seed's prompts (that pays every XLA compilation), the trainer is put back to its initial
    state, and then the measured run trains the whole workload: `num_iterations` batches, the
    same prompts and forced lengths in every mode, all of them trained. Throughput is its
    trained tokens (prompt + response) over its wall time, start to last publish.
    """
    plan = plan_devices(**config.runtime.to_dict())
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
        train_config(rollout_config, config.train),
        plan.train_mesh,
    )
    initial = jax.tree.map(np.array, jax.device_get(trainer.state))
    os.makedirs(workdir, exist_ok=True)
    precompile(engines, trainer, config)
    trainer.restore(initial)
    if config.warmup_iterations > 0:
        warm = dataclasses.replace(rollout_config, num_iterations=config.warmup_iterations)
        prompts = workload(config, config.seed + 1, config.warmup_iterations)
        warm_dir = os.path.join(workdir, "warmup")
        os.makedirs(warm_dir, exist_ok=True)
        Rollout(warm, engines, trainer, prompts, _parity_reward, warm_dir).run()
        trainer.restore(initial)
    prompts = workload(config, config.seed, rollout_config.num_iterations)
    start = time.perf_counter()
    history = Rollout(rollout_config, engines, trainer, prompts, _parity_reward, workdir).run()
    wall = time.perf_counter() - start
    seconds = sum(m["iteration_time_s"] for m in history)
    tokens = sum(m["trained_tokens"] for m in history)
    return {
        "trained_tokens_per_s": tokens / seconds,
        "rollout_time_s": sum(m["rollout_time_s"] for m in history),
        "step_time_s": float(np.mean([m["step_time_s"] for m in history])),
        "bubble_fraction": float(np.mean([m["bubble_fraction"] for m in history])),
        "slot_occupancy": float(np.mean([m["slot_occupancy"] for m in history])),
        "trained_tokens": tokens,
        "measured_seconds": seconds,
        "wall_seconds": wall,
        "trainer_idle_s": sum(m["trainer_idle_s"] for m in history),
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
