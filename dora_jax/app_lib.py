"""The training application behind `dora-jax train` / `make train`, read top to bottom.

config -> devices (one training mesh, N generation meshes) -> data and reward -> policy
(Hugging Face checkpoint or random init) -> SFT warm-up -> held-out evaluation -> RL with the
configured rollout paradigm -> held-out evaluation -> summary (JSON + PNG), with the ledger,
TensorBoard events, trace and checkpoints left in the workdir. The config is checked whole by
`settings_lib` before any of it; the task's prompts, reward and held-out scores are `task_lib`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import IO, Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from dora_jax import models
from dora_jax.config_fields_lib import ConfigError
from dora_jax.engine import Engine
from dora_jax.models import sharding_lib
from dora_jax.observe import metrics_lib, plots_lib, progress_lib
from dora_jax.rollout.runner_lib import Rollout
from dora_jax.runtime import hosts_lib, training_hosts_lib
from dora_jax.runtime.devices_lib import DevicePlan
from dora_jax.settings_lib import (
    DTYPES,
    Settings,
    check_inputs,
    check_same_run,
    engine_sampling,
    longtail_task,
    lora_config,
    model_shape,
    reward_runner,
    run_defining_fields,
    stop_strings,
    validate,
)
from dora_jax.task_lib import (
    PromptStream,
    RewardAdapter,
    TaskData,
    evaluate,
    held_out_due,
    heldout_records,
    load_task,
    prompt_records,
)
from dora_jax.train import sft_lib
from dora_jax.train.checkpoint_lib import Checkpointer
from dora_jax.train.config_lib import TrainConfig
from dora_jax.train.trainer_lib import MirroredTrainer, Trainer

# -- training group -----------------------------------------------------------------------------


def start_training_hosts(config: ml_collections.ConfigDict) -> training_hosts_lib.Group | None:
    """Joins the training group of `runtime.training_hosts`, if any: first thing in a run, since
    a process must join before JAX computes anything."""
    field = "runtime.training_hosts"
    value = config.runtime.get("training_hosts", "")
    if not isinstance(value, str):
        raise ConfigError(f"{field}={value!r}: expected '', 'local:N' or HOST:PORT,...")
    if not value:
        return None
    if value.startswith("local:"):
        count = value.removeprefix("local:")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"{field}={value!r}: 'local:N' needs a count N >= 1")
        return training_hosts_lib.start_local(int(count))
    addresses = [a.strip() for a in value.split(",")]
    try:
        for address in addresses:
            hosts_lib.parse_address(address, field)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not config.runtime.coordinator:
        raise ConfigError(
            f"runtime.coordinator: network training hosts ({field}={value!r}) need this "
            "machine's HOST:PORT for the group's coordination service"
        )
    return training_hosts_lib.connect(addresses, config.runtime.coordinator)


# -- policy -------------------------------------------------------------------------------------


def _checkpointer(config: ml_collections.ConfigDict, workdir: str) -> Checkpointer:
    return Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)


# The params' dtype whatever `model.dtype` computes in: the optimizer's updates land on float32
# master weights. In bfloat16 (8 bits of mantissa) an update smaller than about 1/256 of a weight
# rounds away, and RL's ~1e-6 learning rates are far below that: the policy would not move.
PARAM_DTYPE = jnp.float32


def load_policy(
    config: ml_collections.ConfigDict, vocab_size: int, mesh: jax.sharding.Mesh
) -> models.Transformer:
    """The starting policy, sharded on this process's part of the training `mesh`.

    A checkpoint loads straight onto it, shard by shard, so a model larger than one device
    loads. With training hosts this process alone loads and hands the group its params as host
    arrays, so it takes only its own part of a mesh that spans the group. A random init is tiny
    (the default models): made on one device, then sharded.
    """
    dtype = DTYPES[config.model.dtype]
    mesh = _this_process_part(mesh)
    kwargs = {"param_dtype": PARAM_DTYPE, "dtype": dtype, "lora": lora_config(config)}
    if config.model.checkpoint:
        path = config.model.checkpoint
        return models.from_pretrained(path, mesh=mesh, seed=config.seed, **kwargs)
    model_config = models.ModelConfig(vocab_size=vocab_size, **model_shape(config))
    model = models.create(model_config, seed=config.seed, **kwargs)
    return sharding_lib.shard_model(model, mesh)


def warm_up(
    config: ml_collections.ConfigDict,
    model: models.Transformer,
    data: TaskData,
    mesh: jax.sharding.Mesh,
    progress: bool,
    group: training_hosts_lib.Group | None = None,
) -> models.Transformer:
    """Supervised warm-up on demonstrations (skipped when there are none or sft.steps == 0),
    on every process of the training `group` when there is one."""
    steps = config.sft.steps
    if not data.demonstrations and steps:
        logging.warning(
            "sft.steps=%d: no warm-up, as data.source=%s has no demonstrations; RL starts from "
            "the model as it is (set sft.steps=0 to say so)",
            steps,
            config.data.source,
        )
    if not data.demonstrations or steps == 0:
        return model
    if config.sft.batch_size > len(data.demonstrations):
        raise ValueError(
            f"sft.batch_size={config.sft.batch_size}: more than the task's "
            f"{len(data.demonstrations)} demonstrations (a batch draws without replacement)"
        )
    tok = data.tokenizer
    examples = [
        (tok.encode(prompt), tok.encode(response) + [tok.eos_id])
        for prompt, response in data.demonstrations
    ]
    length = max(len(p) + len(r) for p, r in examples)
    lr = config.sft.learning_rate
    if group is None:
        trainer = sft_lib.SupervisedTrainer(model, mesh, lr, steps, config.train.remat)
        step, finish = trainer.step, trainer.model
    else:
        graphdef, state = nnx.split(model)
        tp = mesh.shape["tp"]
        mirrored = group.make(
            _group_sft, graphdef, jax.device_get(state), tp, lr, steps, config.train.remat
        )

        def step(tokens: np.ndarray, mask: np.ndarray) -> float:
            return mirrored.call("step", tokens, mask)

        def finish() -> models.Transformer:
            params = mirrored.get("params")
            mirrored.close()  # the hosts let go of the warm-up's params and optimizer state
            return nnx.merge(graphdef, params)

    rng = np.random.default_rng(config.seed)
    display = progress_lib.ProgressDisplay(steps, "sft", live=progress)
    try:
        for n in range(1, steps + 1):
            picks = rng.choice(len(examples), config.sft.batch_size, replace=False)
            tokens, mask = sft_lib.pack_examples([examples[i] for i in picks], length, tok.pad_id)
            loss = step(tokens, mask)
            if n % 50 == 0 or n == steps:
                display.update(n, {"train/loss": loss})
    finally:
        display.close()
    return finish()


# A training group's objects are built on every process from host arrays (the factories are
# pickled to the hosts by name); their mesh is every device of the group.


def _group_mesh(tp: int) -> jax.sharding.Mesh:
    devices = jax.devices()
    return sharding_lib.make_mesh(devices, fsdp=len(devices) // tp, tp=tp)


def _group_sft(
    graphdef: Any, state: Any, tp: int, lr: float, steps: int, remat: str
) -> sft_lib.SupervisedTrainer:
    model = nnx.merge(graphdef, state)
    return sft_lib.SupervisedTrainer(model, _group_mesh(tp), lr, steps, remat)


def _group_trainer(graphdef: Any, state: Any, tp: int, config: TrainConfig) -> Trainer:
    model = nnx.merge(graphdef, state)
    return Trainer(model, config, _group_mesh(tp), reference_model=model)


# -- the run ------------------------------------------------------------------------------------


def _engine_settings(config: ml_collections.ConfigDict, eos_ids: Sequence[int]) -> dict[str, Any]:
    prompt, response = config.data.max_prompt_len, config.engine.max_decode_length
    # `partial` re-prefills prompt + tokens so far after every weight update; the KV cache
    # still holds one prompt and the longest response, as in the other modes.
    prefill = prompt + response if config.rollout.mode == "partial" else prompt
    return {
        "max_concurrent_decodes": config.engine.slots,
        "max_prefill_length": prefill,
        "cache_length": prompt + response,
        "max_decode_length": response,
        "sampling": engine_sampling(config),
        "eos_ids": tuple(eos_ids),
    }


def make_engines(
    config: ml_collections.ConfigDict,
    model: models.Transformer,
    plan: DevicePlan,
    eos_ids: Sequence[int],
) -> list[Engine]:
    """One engine per generation mesh; the rollout's unless it runs on generation hosts, and
    the first is the held-out evaluation's. With hosts on other machines the plan has no
    generation mesh: evaluation (before and after training and at the `eval.every` barriers)
    uses the training mesh (this process's part of it, with training hosts)."""
    settings = _engine_settings(config, eos_ids)
    meshes = plan.generation_meshes or (_this_process_part(plan.train_mesh),)
    return [Engine(model, mesh=mesh, **settings) for mesh in meshes]


def _this_process_part(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh`, or where it spans a training group, the part of it on this process's devices,
    which this process alone can compute on."""
    ours = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(ours) == mesh.size:
        return mesh
    tp = mesh.shape["tp"] if len(ours) % mesh.shape["tp"] == 0 else 1
    return sharding_lib.make_mesh(ours, fsdp=len(ours) // tp, tp=tp)


def start_generation_hosts(
    config: ml_collections.ConfigDict,
    hosts: Sequence[str],
    model: models.Transformer,
    eos_ids: Sequence[int],
) -> list[hosts_lib.RemoteEngine]:
    """One generation host per rollout instance (`Settings.generation_hosts`), each a process
    with its own engine of the model's shape (weights come from the trainer, version by
    version)."""
    dtype = DTYPES[config.model.dtype]
    spec = hosts_lib.EngineSpec(
        model.config,
        config.seed,
        _engine_settings(config, eos_ids),
        devices=config.runtime.devices_per_instance,
        tp=config.runtime.instance_tp,
        model_kwargs={"param_dtype": PARAM_DTYPE, "dtype": dtype, "lora": lora_config(config)},
    )
    timeout_s = config.runtime.host_timeout_s
    if hosts[0] == "local":
        return hosts_lib.start_local_hosts([spec] * len(hosts), timeout_s)
    return hosts_lib.connect_hosts(hosts, [spec] * len(hosts), timeout_s)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, progress: bool | None = None
) -> dict[str, Any]:
    """Runs the whole application, resuming from the newest checkpoint in `workdir` if any;
    returns (and writes) `summary.json`."""
    if "://" in workdir:
        # Checkpoints would go there through orbax, the ledger, metrics and trace to a local
        # directory named after it, and a resume on another machine would find no ledger.
        raise ConfigError(
            f"workdir {workdir!r}: a local directory is needed (mount a bucket with gcsfuse)"
        )
    start = time.perf_counter()
    group = start_training_hosts(config)
    try:
        # What the run holds until it ends, however it ends (the workdir's lock): an exception's
        # traceback keeps the run's frame, and with it a plain local, alive after the run.
        with contextlib.ExitStack() as held:
            return _train_and_evaluate(config, workdir, progress, group, start, held)
    finally:
        if group is not None:
            group.close()


def _train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    progress: bool | None,
    group: training_hosts_lib.Group | None,
    start: float,
    held: contextlib.ExitStack,
) -> dict[str, Any]:
    settings = validate(config)
    check_inputs(config)
    data = load_task(config)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir}: a file, not a directory")
    os.makedirs(workdir, exist_ok=True)
    held.enter_context(_lock_workdir(workdir))
    runner = reward_runner(config)
    checkpointer = _checkpointer(config, workdir)
    latest = checkpointer.latest_step()
    if latest is not None:  # before anything of the saved run is restored or cut back
        saved_meta = checkpointer.read_meta(latest)
        check_same_run(saved_meta.get("config"), config, workdir)
        _check_same_rows(saved_meta.get("train_rows"), len(data.train_rows), workdir)
        if latest > settings.rollout.num_iterations:
            raise ConfigError(
                f"{workdir} holds a run at version {latest}, past "
                f"rollout.num_iterations={settings.rollout.num_iterations}: ask for more to "
                "continue it (`dora-jax eval` scores it as it is)"
            )
    model = load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    if latest is None:
        model = warm_up(config, model, data, settings.plan.train_mesh, progress, group)
    engines = make_engines(config, model, settings.plan, data.tokenizer.eos_ids)
    # With `train.kl_coef` > 0 the KL penalty's reference is the policy RL starts from (after
    # the warm-up); the trainer keeps it in its checkpointed state, so a resume restores it.
    if group is None:
        trainer = Trainer(model, settings.train, settings.plan.train_mesh, reference_model=model)
    else:
        graphdef, state = nnx.split(model)
        tp = settings.plan.train_mesh.shape["tp"]
        trainer = MirroredTrainer(
            group.make(_group_trainer, graphdef, jax.device_get(state), tp, settings.train)
        )
    iterator = iter(prompt_records(config, data, data.train_rows))
    heldout = heldout_records(config, data)

    if latest is None:
        initial = engines[0].load_params(version=0)
        before = evaluate(engines[0], initial, heldout, config, runner, data.tokenizer)
        meta: dict[str, Any] = {
            "heldout_before": before,
            "sft_seconds": time.perf_counter() - start,
        }
        resume = None
    else:
        restored = checkpointer.restore(
            latest, train_state_like=_train_arrays(trainer.state), data_iterator=iterator
        )
        meta = restored.meta
        trainer.restore({**restored.train_state, **meta["trainer"]})
        resume = meta["rollout"]
        print(f"resumed from the checkpoint of version {latest} in {workdir}", flush=True)

    prompts = PromptStream(
        iterator,
        settings.rollout.group_size,
        config.engine.max_decode_length,
        first_id=resume["next_prompt"] if resume else 0,
        stop_strings=stop_strings(config),
        text_stream=data.tokenizer.text_stream,
    )
    reward = RewardAdapter(runner, data.tokenizer, prompts, settings.overlong)
    if resume:  # the counters are cumulative over the run, not over this process
        reward.restore_metrics(meta.get("reward_counters", {}))
    writer = metrics_lib.MetricsWriter(
        workdir, resume and meta["metrics_offset"], first_step=resume["newest"] + 1 if resume else 1
    )
    display = progress_lib.ProgressDisplay(settings.rollout.num_iterations, "rl", live=progress)
    rl_start = time.perf_counter() - meta.get("rl_seconds", 0.0)

    # Held-out scores of a barrier's version, logged with the next iteration (the barrier's own
    # record is written by then); kept in its checkpoint, so a resumed run logs them too.
    pending_eval: dict[str, float] = dict(meta.get("pending_eval", {}))

    def held_out_of_trainer() -> dict[str, float]:
        """Held-out scores of the trainer's params, at rest (a barrier, or the run's end)."""
        params = engines[0].shard_params(trainer.params, trainer.version)
        return evaluate(engines[0], params, heldout, config, runner, data.tokenizer)

    def on_iteration(metrics: dict[str, float]) -> None:
        step = int(metrics["iteration"]) + 1
        metrics = {
            **metrics,
            **pending_eval,
            **reward.metrics(),
            **{f"data/skipped_{k}": float(v) for k, v in iterator.skipped.items()},
            "wall_time_s": time.perf_counter() - rl_start,
        }
        pending_eval.clear()
        writer.write(step, metrics)
        display.update(step, metrics)

    def on_checkpoint(rollout_state: dict[str, Any]) -> None:
        version = rollout_state["newest"]
        # The last version's scores too: they are the run's `heldout_after`, and a run asked
        # to go on logs them with its first iteration.
        if held_out_due(version, config.eval.every, config.checkpoint.every):
            pending_eval.update({f"eval/{k}": v for k, v in held_out_of_trainer().items()})
            pending_eval["eval/version"] = float(version)
        state = trainer.state
        checkpoint_meta = {
            **meta,
            "config": run_defining_fields(config),
            "train_rows": len(data.train_rows),
            "seed": config.seed,
            "rollout": rollout_state,
            "trainer": {k: int(v) for k, v in state.items() if k not in _TRAIN_ARRAYS},
            "metrics_offset": writer.offset(),
            "rl_seconds": time.perf_counter() - rl_start,
            "reward_counters": reward.metrics(),
            "pending_eval": dict(pending_eval),
        }
        checkpointer.save(
            rollout_state["newest"],
            train_state=_train_arrays(state),
            data_iterator=iterator,
            meta=checkpoint_meta,
        )

    hosts = []
    if settings.generation_hosts:
        hosts = start_generation_hosts(
            config, settings.generation_hosts, model, data.tokenizer.eos_ids
        )
    rollout = Rollout(
        settings.rollout,
        hosts or engines,
        trainer,
        prompts,
        reward,
        workdir,
        on_iteration=on_iteration,
        checkpoint_every=config.checkpoint.every,
        on_checkpoint=on_checkpoint,
        resume=resume,
    )
    try:
        rollout.run()
    finally:  # also when the run raises or is interrupted:
        for host in hosts:
            host.close()
        display.close()  # gives the terminal its cursor back
        writer.close()
        checkpointer.close()  # waits for a save in flight, which would otherwise be lost
    rl_end = time.perf_counter()
    rl_seconds = rl_end - rl_start

    trained = trainer.params
    if pending_eval.get("eval/version") == trainer.version:  # scored at the last barrier
        after = {k.removeprefix("eval/"): v for k, v in pending_eval.items() if k != "eval/version"}
    else:
        after = held_out_of_trainer()
    runner.close()
    nnx.update(model, trained)
    _save_policy(config, model, os.path.join(workdir, "hf_policy"))
    records = metrics_lib.read_metrics(workdir)
    trained_tokens = sum(r.get("trained_tokens", 0.0) for r in records)
    summary = {
        "mode": settings.rollout.mode,
        "iterations": len(records),
        "heldout_accuracy_before": meta["heldout_before"].get("pass@1"),
        "heldout_accuracy_after": after.get("pass@1"),
        "heldout_before": meta["heldout_before"],
        "heldout_after": after,
        "sft_seconds": meta["sft_seconds"],
        "rl_seconds": rl_seconds,
        # The run's, summed over its invocations: the warm-up and first held-out pass, RL,
        # and this ending (a resume's own start-up, loading and restoring, is left out).
        "wall_time_s": meta["sft_seconds"] + rl_seconds + time.perf_counter() - rl_end,
        "trained_tokens_per_s": trained_tokens / max(rl_seconds, 1e-9),
        "rollout_totals": dict(rollout.totals),
        "reward_counters": reward.metrics(),
        "skipped_rows": dict(iterator.skipped),
        "resumed_from": latest,
    }
    _write_summary(workdir, summary, records)
    return summary


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """`dora-jax eval`: held-out pass@1 / pass@k of the newest checkpoint in `workdir` (or of
    the starting policy when there is none yet)."""
    settings = validate(config)
    _check_workdir(workdir)
    check_inputs(config)
    data = load_task(config)
    model = load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    engine = make_engines(config, model, settings.plan, data.tokenizer.eos_ids)[0]
    step, saved = _checkpoint_params(config, settings, workdir, model)
    if step is None:
        logging.warning(
            "%s holds no checkpoint: scoring the policy a run would start from", workdir
        )
    params = engine.load_params(version=0) if step is None else engine.shard_params(saved, step)
    runner = reward_runner(config)
    scores = evaluate(engine, params, heldout_records(config, data), config, runner, data.tokenizer)
    runner.close()
    return {"version": float(step or 0), **scores}


def export_checkpoint(
    config: ml_collections.ConfigDict,
    workdir: str,
    version: int | None = None,
    out: str | None = None,
) -> str:
    """`dora-jax export`: writes the policy of checkpoint `version` (None: the newest) in
    `workdir` as a Hugging Face model directory, as the run's `hf_policy` is written (in
    `model.dtype`, with `model.checkpoint`'s tokenizer and generation files); returns its path,
    by default `WORKDIR/hf_policy_v<version>`."""
    settings = validate(config)
    _check_workdir(workdir)
    check_inputs(config)
    if out is not None:
        _check_export_directory(config, workdir, out)
    data = load_task(config)
    model = load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    step, params = _checkpoint_params(config, settings, workdir, model, version)
    if step is None:
        raise ConfigError(f"{workdir} holds no checkpoint to export")
    nnx.update(model, params)
    out = out or os.path.join(workdir, f"hf_policy_v{step}")
    _save_policy(config, model, out)
    return out


def _save_policy(config: ml_collections.ConfigDict, model: models.Transformer, out: str) -> None:
    """The policy as a Hugging Face model directory in `model.dtype` (what the engines ran and
    `eval` scored), with `model.checkpoint`'s tokenizer and generation files; a LoRA policy
    merged, and its adapters alone in PEFT's format under `adapter/` as well."""
    source = config.model.checkpoint or None
    models.save_pretrained(model, out, source=source, dtype=DTYPES[config.model.dtype])
    if source is None and config.data.source == "longtail":
        # The built-in task's tokenizer goes along, so the policy reloads as a model.checkpoint.
        longtail_task(config).tokenizer().save(out)
    if model.lora is not None:
        models.save_adapter(model, os.path.join(out, models.hf_io.ADAPTER_DIR), base=source)


def _check_same_rows(saved: int | None, now: int, workdir: str) -> None:
    """Refuses to resume over training data with another number of rows: the saved data
    iterator's position (and every prompt id after it) would point at other rows. (None: a
    checkpoint from before the count was saved.)"""
    if saved is not None and saved != now:
        raise ConfigError(
            f"data.train_files: {now} rows now, {saved} when the run in {workdir} was saved; "
            "its data iterator would go on at other rows: restore the files, or start anew in "
            "another workdir"
        )


def _check_export_directory(config: ml_collections.ConfigDict, workdir: str, out: str) -> None:
    """Refuses an `--out` that is a file, the model the run started from (its files would be
    replaced by the trained ones), or inside the run's checkpoints."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out={out}: a file, not a directory")
    real = os.path.realpath(out)
    source = config.model.checkpoint
    if source and real == os.path.realpath(source):
        raise ConfigError(f"--out={out} is model.checkpoint, the model the run started from")
    checkpoints = os.path.realpath(os.path.join(workdir, "checkpoints"))
    if os.path.commonpath([real, checkpoints]) == checkpoints:
        raise ConfigError(f"--out={out} is inside the run's checkpoints; name another directory")


def _lock_workdir(workdir: str) -> IO[str]:
    """Holds `WORKDIR/.lock` while the returned file is open; the kernel frees it however the
    process ends. Two `train`s on one workdir (a job requeued while the old one still ran) both
    ran, mixing their checkpoints, metrics and summary."""
    lock = open(os.path.join(workdir, ".lock"), "a+")  # noqa: SIM115 - held past this function
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process"
        lock.close()
        raise ConfigError(
            f"--workdir={workdir}: another dora-jax train is running in it ({holder}); wait for "
            "it to end or stop it, then the same command resumes"
        ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def _check_workdir(workdir: str) -> None:
    if not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} does not exist: name a training run's workdir")


def _checkpoint_params(
    config: ml_collections.ConfigDict,
    settings: Settings,
    workdir: str,
    model: models.Transformer,
    step: int | None = None,
) -> tuple[int | None, Any]:
    """(step, the trainer's params saved there) for checkpoint `step` of `workdir` (None: the
    newest), restored onto the training mesh, and nothing else of the train state; (None, None)
    when there is no checkpoint. A checkpoint of another model is refused, naming the fields
    that differ; other settings (the trainer's among them) may differ freely."""
    # Orbax's manager creates its directory, and reading a workdir must not change it.
    exists = os.path.isdir(os.path.join(workdir, "checkpoints"))
    checkpointer = _checkpointer(config, workdir) if exists else None
    try:
        steps = checkpointer.all_steps() if checkpointer else []
        if step is not None and step not in steps:
            raise ConfigError(f"{workdir} has no checkpoint of version {step}; it has {steps}")
        step = step if step is not None else (steps[-1] if steps else None)
        if step is None:
            return None, None
        saved = checkpointer.read_meta(step).get("config")
        # The checkpoint holds float32 master weights whatever the run computed in, so a
        # bfloat16 run exports (or is evaluated) in float32 as well, and the other way round.
        check_same_run(
            saved, config, workdir, prefixes=("model.",), exempt=("model.dtype",),
            advice="read it with the model settings it was trained under (the run's config file)",
        )  # fmt: skip
        _, params = models.Functional.of(model)
        shardings = sharding_lib.param_shardings(params, settings.plan.train_mesh)
        like = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings
        )
        return step, checkpointer.restore_params(step, like)
    finally:
        if checkpointer:
            checkpointer.close()


# The reference only with a KL penalty, the TIS history only with `train.tis_cap`.
_TRAIN_ARRAYS = ("params", "opt_state", "reference", "tis_history")


def _train_arrays(state: dict[str, Any]) -> dict[str, Any]:
    """The array part of the trainer's state (the rest is counters, kept in the JSON meta)."""
    return {k: state[k] for k in _TRAIN_ARRAYS if k in state}


def format_accuracy(accuracy: float | None) -> str:
    """A pass rate as a percentage, or "n/a" for a run without held-out evaluation."""
    return "n/a" if accuracy is None else f"{100 * accuracy:.1f}%"


def _write_summary(workdir: str, summary: dict[str, Any], records: Sequence[dict]) -> None:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    plots_lib.plot_summary(
        records,
        os.path.join(workdir, "summary.png"),
        title=f"dora_jax {summary['mode']}: held-out pass@1 "
        f"{format_accuracy(before)} -> {format_accuracy(after)}",
        held_out=[
            (v, p) for v, p in ((0, before), (summary["iterations"], after)) if p is not None
        ],
    )
