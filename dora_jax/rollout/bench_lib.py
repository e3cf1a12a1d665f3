"""`dora-jax bench`: every rollout paradigm on one seeded long-tail workload, side by side.

Same model initialisation, same prompts, same forced response lengths (EOS ignored until each
request's drawn length), same engines, same trainer settings: only the scheduling differs, so the
ratios between modes are what the paradigm buys. Compilation and a warm-up run of each mode come
before anything is measured; the modes then take turns over `repeats` measured runs and each
figure is the median. The ledgers and traces of every mode stay under `WORKDIR/<mode>/` for the
audit and Perfetto. A `mode@variant` entry runs a mode with other rollout settings
(`rollout_configs`) on the same work, in the same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from dora_jax import models
from dora_jax.config_fields_lib import ConfigError, check_integer_fields
from dora_jax.engine import Engine, SamplingParams
from dora_jax.engine.engine_lib import prompt_row_counts
from dora_jax.engine.request_lib import Request as EngineRequest
from dora_jax.rollout import audit_lib, ledger_lib, request_lib, telemetry_lib
from dora_jax.rollout.config_lib import RolloutConfig, train_config
from dora_jax.rollout.runner_lib import Rollout
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.runtime import cpu_cores_lib, hosts_lib
from dora_jax.runtime.devices_lib import DevicePlan, plan_devices
from dora_jax.runtime.trainer_process_lib import TrainerProcess, TrainerSpec
from dora_jax.train import Trainer
from dora_jax.train.trainer_lib import TrainerLike

REPORTED = ("trained_tokens_per_s", "rollout_time_s", "step_time_s", "bubble_fraction",
            "slot_occupancy")  # fmt: skip
# The printed table adds the schedule's decode cost in logical units (noise-free) and the CPU
# time this process spent on the run: no run can take less wall time than its CPU-seconds over
# the cores this process runs on, which bounds how far better overlap alone could take a mode.
TABLE = (*REPORTED, "instance_steps", "cpu_seconds")


def _parity(prompt_id: int, tokens: np.ndarray) -> float:
    """A cheap deterministic reward with both outcomes in every group, so updates are real."""
    return float((int(tokens.sum()) + prompt_id) % 2)


_parity_reward = request_lib.per_sample(_parity)


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


def precompile_engines(engines: list[Engine], decode_steps: Iterable[int], vocab_size: int) -> None:
    """Compiles what a short warm-up run may miss: every prefill bucket, batch size and count
    of distinct prompts of every engine (admission prefills a turn's requests together, a
    group's samples sharing their prompt; the partial paradigm re-prefills prompt + generated
    tokens, any length), a decode call of each of `decode_steps` steps and every slot move.
    `vocab_size` is the model's: engines on generation hosts hold no model config here."""
    for engine in engines:
        params = engine.load_params()
        # A prefill's rows are padded to a power of two, so these counts give every row count
        # admission can take, up to the one that holds all slots (e.g. 32 rows for 24), each
        # with every count of rows the model may run on (`prompt_row_counts`).
        slots = engine.max_concurrent_decodes
        counts = [min(1 << i, slots) for i in range((slots - 1).bit_length() + 1)]
        for bucket in engine.prefill_buckets:
            for n in counts:
                rows = 1 << (n - 1).bit_length()
                for prompt_rows in prompt_row_counts(rows):
                    distinct = n if prompt_rows == rows else prompt_rows
                    requests = [
                        EngineRequest(
                            prompt_tokens=_numbered_prompt(i % distinct, bucket, vocab_size),
                            max_new_tokens=1,
                            ignore_eos=True,
                            seed=0,
                            id=(-1, i),
                        )
                        for i in range(n)
                    ]
                    state, _ = engine.admit(params, engine.init_decode_state(), requests, range(n))
                    jax.block_until_ready(state)
        # The slot moves a run may first need mid-measurement: decode, a migration (export +
        # import), free.
        request = EngineRequest(prompt_tokens=[1], max_new_tokens=2, seed=0, id=(-1, 0))
        state, _ = engine.admit(params, engine.init_decode_state(), [request], [0])
        for steps in sorted(set(decode_steps)):
            state, result = engine.generate_steps(params, state, steps)
            result.convert_to_numpy()
        exported = engine.export_slot(state, 0)
        state = engine.free_slot(state, 0)
        state = engine.import_slot(state, 1, exported)
        jax.block_until_ready(engine.free_slot(state, 1))


def _numbered_prompt(number: int, length: int, vocab: int) -> np.ndarray:
    """A prompt of `length` tokens that spells `number` in base `vocab`: prompts of different
    numbers differ (any vocabulary), so a prefill of them shares nothing it should not."""
    return np.asarray([number // vocab**k % vocab for k in range(length)], np.int32)


def precompile_trainer(trainer: TrainerLike, config: ml_collections.ConfigDict) -> None:
    """Compiles a training step per micro-batch shape the workload can meet; the caller
    restores the trainer's state. Rows of one length cover each length bucket; under a token
    budget (`train.micro_batch_tokens`) each bucket also needs every smaller power-of-two row
    count, which a batch of that many rows of the bucket's length, the rest of the longest,
    gives wherever the longest rows cannot join them."""
    r, w = config.rollout, config.workload
    longest = w.prompt_length + w.max_length
    tbs, buckets = r.train_batch_size, tuple(config.train.length_buckets)
    lengths = []
    for bucket in buckets:
        n = min(bucket, longest) - w.prompt_length
        if n >= 1:
            lengths.append(n)
        if bucket >= longest:
            break
    batches = [[n] * tbs for n in lengths]
    if config.train.get("micro_batch_tokens"):
        batches += [[n] * rows + [lengths[-1]] * (tbs - rows) for n in lengths[:-1]
                    for rows in _powers_of_two(tbs - 1)]  # fmt: skip
    for batch in batches:
        trainer.step(training_batch(config, batch, trainer.version))


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    return [1 << i for i in range(limit.bit_length())]


def response_lengths(
    config: ml_collections.ConfigDict, count: int, rng: np.random.Generator
) -> np.ndarray:
    """`count` response lengths from the workload's heavy-tailed log-normal, in 1 ..
    `max_length`: the shapes a training step of this workload meets."""
    w = config.workload
    lengths = np.exp(np.log(w.median_length) + w.sigma * rng.standard_normal(count))
    return np.clip(lengths, 1, w.max_length).astype(int)


def training_batch(
    config: ml_collections.ConfigDict, lengths: Sequence[int], version: int
) -> list[Trajectory]:
    """Trajectories of the workload's prompt length with these response lengths, sampled at
    `version`, in groups of the rollout's size: a training step's input of this workload's
    shapes, for compiling and timing one."""
    r, w = config.rollout, config.workload
    return [
        Trajectory(
            prompt_id=i // r.group_size,
            sample_index=i % r.group_size,
            prompt_tokens=np.ones(w.prompt_length, np.int32),
            response_tokens=np.ones(n, np.int32),
            behaviour_logprobs=np.zeros(n, np.float32),
            version=version,
            token_versions=np.full(n, version, np.int32),
            reward=float(i % 2),
        )
        for i, n in enumerate(lengths)
    ]


def _engines(
    config: ml_collections.ConfigDict, model: models.Transformer, plan: DevicePlan
) -> list[Engine]:
    """One engine per generation mesh, shared by every mode. Prefill room for prompt plus a
    whole response: only `partial` uses it (it re-prefills prompt + generated-so-far after
    every weight update); the other modes never leave the prompt's bucket. The KV cache holds
    exactly one prompt plus the longest response, whatever was re-prefilled, so a decode step
    costs the same in every mode."""
    w = config.workload
    settings = {
        "max_concurrent_decodes": config.engine.slots,
        "max_prefill_length": w.prompt_length + w.max_length,
        "max_decode_length": w.max_length,
        "cache_length": w.prompt_length + w.max_length,
        "sampling": SamplingParams(temperature=config.engine.temperature),
    }
    if config.runtime.generation_hosts == "local":  # each engine in a child process
        r = config.runtime
        spec = hosts_lib.EngineSpec(
            model.config, config.seed, settings, r.devices_per_instance, r.get("instance_tp", 1)
        )
        return hosts_lib.start_local_hosts([spec] * r.num_instances)
    return [Engine(model, mesh=mesh, **settings) for mesh in plan.generation_meshes]


def run_mode(
    config: ml_collections.ConfigDict,
    rollout_config: RolloutConfig,
    engines: list[Engine],
    trainer: TrainerLike,
    workdir: str,
) -> dict[str, float]:
    """One measured run of one paradigm over the whole workload (`num_iterations` batches, the
    same prompts and forced lengths in every mode, all of them trained); returns the figures of
    `REPORTED` plus the audit verdict. Throughput is its trained tokens (prompt + response) over
    its wall time, start to last publish. `cpu_seconds` is the process's user + system time
    over the run (every thread: controller, trainer, XLA's device threads; a trainer process
    and generation hosts' processes are not counted). The trainer must hold the initial
    state."""
    prompts = workload(config, config.seed, rollout_config.num_iterations)
    cpu_start = time.process_time()
    start = time.perf_counter()
    history = Rollout(rollout_config, engines, trainer, prompts, _parity_reward, workdir).run()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
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
        "cpu_seconds": cpu,
        "cpu_cores": cpu / wall,
        "trainer_idle_s": sum(m["trainer_idle_s"] for m in history),
        **schedule_figures(history),
        "audit_passed": audit_lib.audit(workdir).passed,
    }


def schedule_figures(history: list[dict[str, float]]) -> dict[str, float]:
    """The run's schedule in logical units: decode steps, instance steps (all, and by the hosted
    version's lag behind the newest) and the slot occupancy of those steps (step-weighted). They
    depend on the config and seed only, not on the machine or the model's tokens (lengths are
    forced), so an engine double that honours the engine's contract gives the same figures."""
    figures = {
        "decode_steps": sum(m.get("decode_steps", 0.0) for m in history),
        "instance_steps": sum(m.get("instance_steps", 0.0) for m in history),
    }
    total_busy = total_slots = 0.0
    for lag in telemetry_lib.LAG_LABELS:
        steps, busy, slots = (
            sum(m.get(f"{kind}/{lag}", 0.0) for m in history)
            for kind in ("instance_steps", "busy_slot_steps", "slot_steps")
        )
        figures[f"instance_steps/{lag}"] = steps
        figures[f"step_occupancy/{lag}"] = busy / slots if slots else 0.0
        total_busy, total_slots = total_busy + busy, total_slots + slots
    figures["step_occupancy"] = total_busy / total_slots if total_slots else 0.0
    return figures


# A variant may retune the schedule, never the work: every entry trains the same samples.
_WORKLOAD_FIELDS = ("mode", "train_batch_size", "group_size", "num_iterations", "seed")


def rollout_configs(config: ml_collections.ConfigDict) -> dict[str, RolloutConfig]:
    """The rollout config of each entry of `config.modes`, in order: a paradigm's name (`dora`)
    runs `config.rollout` as it is; `mode@name` runs it with `config.variants.name`'s fields
    over it, so settings are compared in one process, taking turns with the plain modes (runs
    in separate processes on a shared host differ by more than most settings do)."""
    configs = {}
    for entry in config.modes.split(","):
        mode, _, variant = entry.partition("@")
        fields = {**config.rollout.to_dict(), "mode": mode, "seed": config.seed}
        if variant:
            if variant not in config.get("variants", {}):
                raise ValueError(f"modes: {entry!r} names no entry of config.variants")
            overrides = config.variants[variant].to_dict()
            for field in overrides:
                if field in _WORKLOAD_FIELDS:
                    raise ValueError(
                        f"variants.{variant}.{field}: a variant cannot change the workload "
                        f"(set it in rollout.{field} for every mode)"
                    )
            fields.update(overrides)
        try:
            configs[entry] = RolloutConfig.from_dict(fields)
        except ValueError as e:
            raise ValueError(f"modes: {entry!r}: {e}") from e
    return configs


def run_bench(config: ml_collections.ConfigDict, workdir: str) -> dict[str, dict[str, Any]]:
    """Runs every entry of `config.modes` (a paradigm, or a `mode@variant`, see
    `rollout_configs`) `config.repeats` times, interleaved, and reports each figure's median;
    prints the table and writes `WORKDIR/bench.json`.

    Everything is set up and compiled once: the engines are shared by all modes, and each mode's
    trainer (its staleness guard is the mode's own bound) compiles its steps and runs a
    `warmup_iterations` warm-up of its mode on another seed's prompts before anything is
    measured; the trainer then goes back to its initial state before every measured run. The
    modes take turns, in a rotating order, so that a slow spell of a shared machine hits all of
    them rather than one. Repeat 0 leaves its ledger and trace in `WORKDIR/<mode>/`, later
    repeats in `WORKDIR/<mode>/repeat<r>/`; every repeat must write the same ledger.

    With `runtime.train_cpu_cores` = n > 0 every mode's trainer runs in a process of its own on
    n of the host's cores and this process (controller and engines) keeps the rest, for the run
    only (`cpu_cores_lib`); 0 leaves everything in this process, on every core.
    """
    if "modes" not in config or "workload" not in config:
        raise ConfigError(
            "dora-jax bench runs a bench config (its `modes` and `workload`, as "
            "configs/bench_longtail.py has); `dora-jax train` runs a training config"
        )
    try:  # every field is checked before anything is built or compiled
        configs = rollout_configs(config)
        check_integer_fields(config, {"repeats": 1, "warmup_iterations": 0, "engine.slots": 1})
        for rollout_config in configs.values():
            train_config(rollout_config, config.train, config.engine.temperature)
        runtime = config.runtime.to_dict()
        if runtime.pop("generation_hosts") not in ("", "local"):
            raise ValueError("runtime.generation_hosts: the bench runs '' or 'local' hosts only")
        train_cpu_cores = runtime.pop("train_cpu_cores", 0)
        plan = plan_devices(**runtime)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not train_cpu_cores:
        return _run_bench(config, workdir, configs, plan, None)
    train_cores, rollout_cores = cpu_cores_lib.split(train_cpu_cores)
    # Engines and generation hosts start inside the block, so they keep to rollout's cores.
    with cpu_cores_lib.pinned(rollout_cores):
        return _run_bench(config, workdir, configs, plan, train_cores)


def _run_bench(
    config: ml_collections.ConfigDict,
    workdir: str,
    configs: dict[str, RolloutConfig],
    plan: DevicePlan,
    train_cores: frozenset[int] | None,
) -> dict[str, dict[str, Any]]:
    modes = list(configs)
    os.makedirs(workdir, exist_ok=True)
    # The same initialisation for every mode; each trainer owns its copy (its steps donate it).
    model_config = models.ModelConfig(**config.model.to_dict())
    engines = _engines(config, models.create(model_config, seed=config.seed), plan)
    # Compiling comes first and takes minutes on a cold compilation cache: say what it is doing.
    _say(f"compiling the {len(engines)} engines' prefill buckets and decode steps")
    precompile_engines(
        engines, (c.decode_steps_per_turn for c in configs.values()), config.model.vocab_size
    )
    setups = {}
    with contextlib.ExitStack() as trainer_processes:
        for mode, rollout_config in configs.items():
            train = train_config(rollout_config, config.train, config.engine.temperature)
            _say(
                f"{mode}: compiling its trainer, then {config.warmup_iterations} warm-up iterations"
            )
            if train_cores is None:
                model = models.create(model_config, seed=config.seed)
                trainer = Trainer(model, train, plan.train_mesh)
            else:
                fsdp, tp = plan.train_mesh.shape["fsdp"], plan.train_mesh.shape["tp"]
                spec = TrainerSpec(model_config, train, config.seed, fsdp, tp, train_cores)
                trainer = trainer_processes.enter_context(TrainerProcess(spec))
            initial = jax.tree.map(np.array, jax.device_get(trainer.state))
            precompile_trainer(trainer, config)
            trainer.restore(initial)
            if config.warmup_iterations > 0:
                warm = dataclasses.replace(rollout_config, num_iterations=config.warmup_iterations)
                prompts = workload(config, config.seed + 1, config.warmup_iterations)
                warm_dir = os.path.join(workdir, mode, "warmup")
                Rollout(warm, engines, trainer, prompts, _parity_reward, warm_dir).run()
                trainer.restore(initial)
            setups[mode] = (rollout_config, trainer, initial)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        _say(f"measuring: {config.repeats} repeats of {', '.join(modes)}, taking turns")
        for repeat in range(config.repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                rollout_config, trainer, initial = setups[mode]
                run_dir = os.path.join(workdir, mode, *([f"repeat{repeat}"] if repeat else []))
                runs[mode].append(run_mode(config, rollout_config, engines, trainer, run_dir))
                trainer.restore(initial)
                print(f"{mode} (repeat {repeat}): {runs[mode][-1]}", flush=True)
    results = {mode: _summary(runs[mode], os.path.join(workdir, mode)) for mode in modes}
    with open(os.path.join(workdir, "bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(format_table(results))
    return results


def _say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def _summary(runs: list[dict[str, float]], workdir: str) -> dict[str, Any]:
    """Each figure's median over the repeats, every repeat's throughput, and whether every
    repeat wrote the same ledger as repeat 0 (the determinism claim, checked on every bench)."""
    summary: dict[str, Any] = {
        k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "audit_passed"
    }
    summary["audit_passed"] = all(r["audit_passed"] for r in runs)
    summary["trained_tokens_per_s_repeats"] = [r["trained_tokens_per_s"] for r in runs]
    with open(os.path.join(workdir, ledger_lib.LEDGER_FILE), "rb") as f:
        first = f.read()
    identical = True
    for repeat in range(1, len(runs)):
        with open(os.path.join(workdir, f"repeat{repeat}", ledger_lib.LEDGER_FILE), "rb") as f:
            identical &= f.read() == first
    summary["ledgers_identical"] = identical
    return summary


def format_table(results: dict[str, dict[str, Any]]) -> str:
    baseline = results.get("sync", {}).get("trained_tokens_per_s")
    w = max(14, *(len(mode) + 2 for mode in results))
    header = f"{'mode':<{w}}" + "".join(f"{k:>22}" for k in TABLE) + f"{'vs sync':>10}"
    lines = [header]
    for mode, r in results.items():
        ratio = r["trained_tokens_per_s"] / baseline if baseline else float("nan")
        lines.append(f"{mode:<{w}}" + "".join(f"{r[k]:>22.3f}" for k in TABLE) + f"{ratio:>9.2f}x")
    labels = telemetry_lib.LAG_LABELS
    lines.append("instance steps (slot occupancy) by the hosted version's lag behind the newest:")
    lines.append(f"{'mode':<{w}}" + "".join(f"{lag:>22}" for lag in labels))
    for mode, r in results.items():
        cells = [
            f"{r[f'instance_steps/{lag}']:.0f} ({r[f'step_occupancy/{lag}']:.2f})" for lag in labels
        ]
        lines.append(f"{mode:<{w}}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
