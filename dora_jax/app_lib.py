"""The training application behind `dora-jax train` / `make train`, read top to bottom.

config -> devices (one training mesh, N generation meshes) -> data and reward -> policy
(Hugging Face checkpoint or random init) -> SFT warm-up -> held-out evaluation -> RL with the
configured rollout paradigm -> held-out evaluation -> summary (JSON + PNG), with the ledger,
TensorBoard events, trace and checkpoints left in the workdir.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from dora_jax import models
from dora_jax.config_fields_lib import check_integer_fields, check_timeout
from dora_jax.data import (
    BAD_ROW_MODES,
    LongTailTask,
    Tokenizer,
    load_tokenizer,
    make_template,
    memory_rows,
    open_files,
    prompt_dataset,
)
from dora_jax.engine import Engine, Request, SamplingParams, TextStream, generate_all
from dora_jax.models import sharding_lib
from dora_jax.observe import metrics_lib, plots_lib, progress_lib
from dora_jax.rewards import RewardRunner, get_reward
from dora_jax.rewards.shaping_lib import OverlongPenalty
from dora_jax.rollout.config_lib import RolloutConfig, train_config
from dora_jax.rollout.request_lib import PromptSpec
from dora_jax.rollout.runner_lib import Rollout
from dora_jax.runtime import hosts_lib, training_hosts_lib
from dora_jax.runtime.devices_lib import DevicePlan, plan_devices
from dora_jax.train import sft_lib
from dora_jax.train.checkpoint_lib import Checkpointer
from dora_jax.train.config_lib import TrainConfig
from dora_jax.train.trainer_lib import MirroredTrainer, Trainer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_MODEL_SHAPE_FIELDS = {
    f.name for f in dataclasses.fields(models.ModelConfig) if f.name not in ("vocab_size",)
}


# -- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every section of the config, validated; built once at start so mistakes fail early."""

    rollout: RolloutConfig
    train: TrainConfig
    plan: DevicePlan
    # Where the rollout instances' engines run: () in this process, ("local",) * N in child
    # processes, or one HOST:PORT per instance of running `dora-jax host`s.
    generation_hosts: tuple[str, ...]
    overlong: OverlongPenalty


# Every field of the sections `validate` reads itself (`rollout` and `train` check theirs
# against their dataclasses): a field misspelled in a config file would otherwise be ignored,
# its default used in silence. (`--config.x=` overrides of unknown fields fail in absl.)
_SECTION_FIELDS: dict[str, frozenset[str]] = {
    "model": frozenset({"checkpoint", "dtype", *_MODEL_SHAPE_FIELDS}),
    "runtime": frozenset(
        {
            "train_devices",
            "train_tp",
            "num_instances",
            "devices_per_instance",
            "instance_tp",
            "generation_hosts",
            "host_timeout_s",
            "training_hosts",
            "coordinator",
        }
    ),
    "data": frozenset(
        {
            "source",
            "train_files",
            "heldout_files",
            "prompt_field",
            "answer_field",
            "template",
            "max_prompt_len",
            "on_bad_row",
        }
    ),
    "task": frozenset({*(f.name for f in dataclasses.fields(LongTailTask)), "demonstration_noise"}),
    "reward": frozenset(
        {
            "name",
            "options",
            "timeout_s",
            "isolation",
            "workers",
            "overlong_buffer",
            "overlong_penalty",
        }
    ),
    "engine": frozenset(
        {"slots", "max_decode_length", "temperature", "top_k", "top_p", "stop_strings"}
    ),
    "sft": frozenset({"steps", "batch_size", "learning_rate"}),
    "eval": frozenset(
        {"num_prompts", "samples_per_prompt", "every", "temperature", "top_k", "top_p"}
    ),
    "checkpoint": frozenset({"every", "keep"}),
}
# Sections the app reads field by field, so each must be there (`model` and `task` fields take
# their dataclasses' defaults when absent).
_COMPLETE_SECTIONS = ("runtime", "data", "reward", "engine", "sft", "eval", "checkpoint")
_TOP_LEVEL_FIELDS = frozenset(
    {"seed", "num_cpu_devices", "compilation_cache_dir", "rollout", "train", *_SECTION_FIELDS}
)
# Each field's smallest value: counts the run divides by or must have at least one of.
_MINIMA = {
    "engine.slots": 1,
    "engine.max_decode_length": 1,
    "data.max_prompt_len": 1,
    "sft.steps": 0,
    "sft.batch_size": 1,
    "eval.num_prompts": 1,
    "eval.samples_per_prompt": 1,
    "eval.every": 0,  # 0: before and after RL only
    "checkpoint.every": 0,  # 0: no checkpoints
    "checkpoint.keep": 1,
}


def validate(config: ml_collections.ConfigDict) -> Settings:
    """Checks the whole config before any heavy work; errors name the offending field."""
    _check_field_names(config)
    if config.model.dtype not in _DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r}: expected one of {list(_DTYPES)}")
    if config.data.source not in ("longtail", "files"):
        raise ValueError(f"data.source={config.data.source!r}: expected 'longtail' or 'files'")
    if config.data.source == "files" and not config.data.train_files:
        raise ValueError("data.train_files must name at least one file when data.source='files'")
    if config.data.source == "files" and not config.model.checkpoint:
        raise ValueError(
            "model.checkpoint must name a Hugging Face model directory when data.source='files' "
            "(its tokenizer.json tokenizes the files' prompts)"
        )
    if config.data.on_bad_row not in BAD_ROW_MODES:
        raise ValueError(
            f"data.on_bad_row={config.data.on_bad_row!r}: expected one of {BAD_ROW_MODES}"
        )
    check_integer_fields(config, _MINIMA)
    if config.eval.every and not config.checkpoint.every:
        raise ValueError(
            f"eval.every={config.eval.every} needs checkpoint.every > 0: held-out evaluation "
            "runs at checkpoint barriers, where the trainer's params are at rest (or set 0)"
        )
    _named("engine.", lambda: _sampling(config))
    _named("eval.", lambda: eval_sampling(config))
    stop_strings(config)
    if config.data.template != "chat":  # a chat template is the checkpoint's, checked on load
        _named("data.template: ", lambda: make_template(config.data.template))
    if config.data.source == "longtail":
        _longtail_task(config)  # its errors name their task.* field
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "seed": config.seed})
    train = train_config(rollout, config.train)
    reward_runner(config)  # a bad reward fails here, not mid-run (its workers start later)
    overlong = OverlongPenalty(
        int(config.engine.max_decode_length),
        config.reward.overlong_buffer,
        config.reward.overlong_penalty,
    )
    runtime = config.runtime.to_dict()
    hosts = _generation_hosts(runtime.pop("generation_hosts", ""), runtime["num_instances"])
    runtime.pop("coordinator", "")
    _named("runtime.host_", lambda: check_timeout(runtime.pop("host_timeout_s")))
    group = runtime.pop("training_hosts", "")
    if group:
        _check_training_group(group, hosts, runtime["train_devices"])
    plan = plan_devices(
        **runtime, remote_instances=bool(group) or (bool(hosts) and hosts[0] != "local")
    )
    return Settings(
        rollout=rollout, train=train, plan=plan, generation_hosts=hosts, overlong=overlong
    )


def _check_field_names(config: ml_collections.ConfigDict) -> None:
    unknown = sorted(set(config) - _TOP_LEVEL_FIELDS)
    for section, known in _SECTION_FIELDS.items():
        unknown += sorted(f"{section}.{f}" for f in set(config.get(section, {})) - known)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}: misspelled, or not a dora_jax field")
    missing = sorted(
        f"{section}.{f}"
        for section in _COMPLETE_SECTIONS
        for f in _SECTION_FIELDS[section] - set(config.get(section, {}))
    )
    if missing:
        raise ValueError(
            f"config lacks field(s) {missing}: a config file written for an older dora_jax? "
            "Start it from configs/default.py's get_config() and change what differs"
        )


def _named(prefix: str, check: Any) -> Any:
    """Runs `check` and returns its result, prefixing `prefix` to the ValueError of a library
    that only knows its own argument names (`top_p must be in (0, 1]` -> `engine.top_p ...`)."""
    try:
        return check()
    except ValueError as e:
        raise ValueError(f"{prefix}{e}") from e


def _sampling(config: ml_collections.ConfigDict) -> SamplingParams:
    e = config.engine
    return SamplingParams(temperature=e.temperature, top_k=e.top_k, top_p=e.top_p)


def eval_sampling(config: ml_collections.ConfigDict) -> SamplingParams:
    """The held-out samples' sampling: `eval.temperature` / `top_k` / `top_p` where set, the
    engine's (rollout's) elsewhere."""
    e, v = config.engine, config.eval
    pick = lambda value, default: default if value is None else value
    return SamplingParams(
        temperature=pick(v.temperature, e.temperature),
        top_k=pick(v.top_k, e.top_k),
        top_p=pick(v.top_p, e.top_p),
    )


def stop_strings(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """`engine.stop_strings`, checked: a response ends at the first token whose text completes
    one, in rollout and held-out evaluation alike; unlike vLLM's `stop`, the stop string stays
    in the response's text, where a reward may look for it."""
    value = config.engine.stop_strings
    if not isinstance(value, tuple | list) or not all(isinstance(x, str) and x for x in value):
        raise ValueError(
            f"engine.stop_strings={value!r}: expected a tuple of non-empty strings, e.g. "
            "('</answer>',)"
        )
    return tuple(value)


def _longtail_task(config: ml_collections.ConfigDict) -> LongTailTask:
    return LongTailTask(**{k: v for k, v in config.task.items() if k != "demonstration_noise"})


def _check_training_group(value: str, generation_hosts: Sequence[str], train_devices: int) -> None:
    """A run with training hosts has joined their group (`start_training_hosts`) by now."""
    field = "runtime.training_hosts"
    if jax.process_count() == 1:
        raise ValueError(
            f"{field}={value!r}: only `dora-jax train` starts training hosts; set it to '' "
            "(and runtime.train_devices to this machine's devices) for this command"
        )
    if value.startswith("local:") and jax.devices()[0].platform != "cpu":
        raise ValueError(
            f"{field}={value!r} starts training hosts in child processes of this machine, which "
            "only CPU devices allow; run one `dora-jax host` per machine (HOST:PORT,...)"
        )
    if not generation_hosts:
        raise ValueError(
            f"{field}={value!r} needs runtime.generation_hosts: the training mesh takes every "
            "device of the training group, so the rollout instances run on generation hosts"
        )
    if train_devices != jax.device_count():
        raise ValueError(
            f"runtime.train_devices={train_devices}: with {field}={value!r} the training mesh "
            f"is every device of the group, {jax.device_count()} here"
        )


def start_training_hosts(config: ml_collections.ConfigDict) -> training_hosts_lib.Group | None:
    """Joins the training group of `runtime.training_hosts`, if any: first thing in a run, since
    a process must join before JAX computes anything."""
    field = "runtime.training_hosts"
    value = config.runtime.get("training_hosts", "")
    if not isinstance(value, str):
        raise ValueError(f"{field}={value!r}: expected '', 'local:N' or HOST:PORT,...")
    if not value:
        return None
    if value.startswith("local:"):
        count = value.removeprefix("local:")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{field}={value!r}: 'local:N' needs a count N >= 1")
        return training_hosts_lib.start_local(int(count))
    addresses = [a.strip() for a in value.split(",")]
    for address in addresses:
        hosts_lib.parse_address(address, field)
    if not config.runtime.coordinator:
        raise ValueError(
            f"runtime.coordinator: network training hosts ({field}={value!r}) need this "
            "machine's HOST:PORT for the group's coordination service"
        )
    return training_hosts_lib.connect(addresses, config.runtime.coordinator)


def _generation_hosts(value: Any, num_instances: int) -> tuple[str, ...]:
    field = "runtime.generation_hosts"
    if not isinstance(value, str):
        raise ValueError(f"{field}={value!r}: expected '', 'local' or HOST:PORT,...")
    if value == "local" and jax.devices()[0].platform != "cpu":
        raise ValueError(
            f"{field}='local' starts engines in child processes of this machine, which only "
            "CPU devices allow (this process holds the accelerators); use '' or one "
            "`dora-jax host` per machine (HOST:PORT,...)"
        )
    if value in ("", "local"):
        return (value,) * num_instances if value else ()
    addresses = tuple(a.strip() for a in value.split(","))
    for address in addresses:
        hosts_lib.parse_address(address, field)
    if len(addresses) != num_instances:
        raise ValueError(
            f"{field}: {len(addresses)} addresses for runtime.num_instances={num_instances}"
        )
    hosts_lib.host_key()  # a missing key fails here, not at the first connection
    return addresses


# -- data and reward ----------------------------------------------------------------------------


@dataclasses.dataclass
class TaskData:
    tokenizer: Tokenizer
    train_rows: Any  # a RowSource
    heldout_rows: Any  # a RowSource, or None: no held-out evaluation
    demonstrations: list[tuple[str, str]]
    task: LongTailTask | None


def load_task(config: ml_collections.ConfigDict) -> TaskData:
    if config.data.source == "longtail":
        task = _longtail_task(config)
        train = task.rows("train", 20_000, seed=config.seed)
        heldout = memory_rows(task.rows("heldout", config.eval.num_prompts, config.seed + 1))
        demos = task.demonstrations(
            task.rows("train", 20_000, seed=config.seed + 2),
            config.task.demonstration_noise,
            seed=config.seed,
        )
        return TaskData(task.tokenizer(), memory_rows(train, "longtail"), heldout, demos, task)
    fields = (config.data.prompt_field, config.data.answer_field)
    heldout = None
    if config.data.heldout_files:
        heldout = open_files(config.data.heldout_files.split(","), fields)
    train = open_files(config.data.train_files.split(","), fields)
    return TaskData(load_tokenizer(config.model.checkpoint), train, heldout, [], None)


class PromptStream:
    """Rollout's prompt source: prompt id i is the next record of the grain pipeline.

    Rollout asks for prompt ids in order, once each; a record is kept until every sample of its
    group has been scored (each sample is scored once), so that its answer is known then and a
    long run does not hold every prompt it ever read. A resumed run starts at `first_id` with
    the iterator restored to the matching position (the checkpoint barrier leaves no prompt
    half-used).
    """

    def __init__(
        self,
        iterator: Any,
        group_size: int,
        max_new_tokens: int,
        first_id: int = 0,
        stop_strings: tuple[str, ...] = (),
        text_stream: Callable[[], TextStream] | None = None,
    ):
        self.iterator = iterator
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.stop_strings = stop_strings
        self.text_stream = text_stream
        self.next_id = first_id
        self.records: dict[int, dict[str, Any]] = {}
        self._scored: collections.Counter[int] = collections.Counter()

    def __call__(self, prompt_id: int) -> PromptSpec:
        if prompt_id not in self.records:
            if prompt_id != self.next_id:
                raise ValueError(f"prompt {prompt_id} requested out of order ({self.next_id})")
            self.records[prompt_id] = next(self.iterator)
            self.next_id += 1
        record = self.records[prompt_id]
        return PromptSpec(
            prompt_id,
            np.asarray(record["prompt_tokens"], np.int32),
            (self.max_new_tokens,) * self.group_size,
            stop_strings=self.stop_strings,
            text_stream=self.text_stream,
        )

    def answer(self, prompt_id: int) -> str:
        """The reference answer for one sample of the group about to be scored."""
        answer = self.records[prompt_id]["answer"]
        self._scored[prompt_id] += 1
        if self._scored[prompt_id] == self.group_size:
            del self.records[prompt_id], self._scored[prompt_id]
        return answer


def reward_runner(config: ml_collections.ConfigDict) -> RewardRunner:
    """The task's reward under the runner's timeout, in worker processes (`reward.isolation`)."""
    r = config.reward
    fn = get_reward(r.name, **r.options.to_dict())  # its errors name reward.name / .options
    return _named(
        "reward.",
        lambda: RewardRunner(fn, timeout_s=r.timeout_s, workers=r.workers, isolation=r.isolation),
    )


class RewardAdapter:
    """(prompt id, response tokens) -> reward: the task's, through the timeout-safe
    `RewardRunner`, plus the overlong penalty of the response's length."""

    def __init__(
        self,
        runner: RewardRunner,
        tokenizer: Tokenizer,
        prompts: PromptStream,
        overlong: OverlongPenalty,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.overlong = overlong
        self.penalized = 0

    def __call__(self, batch: Sequence[tuple[int, np.ndarray]]) -> list[float]:
        """A turn's finished samples, scored by the runner's workers together."""
        items = [
            (pid, self.tokenizer.decode([int(t) for t in tokens]), self.prompts.answer(pid))
            for pid, tokens in batch
        ]
        rewards = []
        for reward, (_, tokens) in zip(self.runner.score(items), batch, strict=True):
            penalty = self.overlong(len(tokens))
            self.penalized += penalty < 0
            rewards.append(reward + penalty)
        return rewards

    def restore_metrics(self, saved: dict[str, float]) -> None:
        """Continues the counters `metrics()` returned when a checkpoint was saved."""
        self.runner.restore_metrics(saved)
        self.penalized = int(saved.get("reward/overlong_penalized", 0))

    def metrics(self) -> dict[str, float]:
        """Cumulative counters, the reward runner's and the overlong penalty's."""
        return {
            **{k: float(v) for k, v in self.runner.metrics().items()},
            "reward/overlong_penalized": float(self.penalized),
        }


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
    dtype = _DTYPES[config.model.dtype]
    mesh = _this_process_part(mesh)
    if config.model.checkpoint:
        return models.from_pretrained(
            config.model.checkpoint, dtype=dtype, param_dtype=PARAM_DTYPE, mesh=mesh
        )
    shape = {k: v for k, v in config.model.items() if k in _MODEL_SHAPE_FIELDS}
    model_config = models.ModelConfig(vocab_size=vocab_size, **shape)
    model = models.create(model_config, seed=config.seed, param_dtype=PARAM_DTYPE, dtype=dtype)
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


def heldout_records(config: ml_collections.ConfigDict, data: TaskData) -> list[dict[str, Any]]:
    """The first `eval.num_prompts` held-out prompts, through the same pipeline as training
    (template, tokenizer, length limit, bad-row policy)."""
    if data.heldout_rows is None:
        return []
    iterator = iter(_prompt_dataset(config, data, data.heldout_rows, num_epochs=1))
    return [record for record, _ in zip(iterator, range(config.eval.num_prompts), strict=False)]


def held_out_due(version: int, every: int, barrier_every: int) -> bool:
    """Whether the checkpoint barrier of `version` (one every `barrier_every` versions) scores
    the held-out set: the first barrier at or after each multiple of `every` (0: none), i.e.
    one with a multiple of `every` among the versions since the previous barrier."""
    return bool(every) and version // every > (version - barrier_every) // every


def evaluate(
    engine: Engine,
    params: Any,
    records: Sequence[dict[str, Any]],
    config: ml_collections.ConfigDict,
    runner: RewardRunner,
    tokenizer: Tokenizer,
) -> dict[str, float]:
    """pass@1 (mean over k samples) and pass@k on the held-out prompts, sampled as
    `eval_sampling` says."""
    if not records:
        return {}
    k = config.eval.samples_per_prompt
    stops = stop_strings(config)
    sampling = eval_sampling(config)
    requests = [
        Request(
            prompt_tokens=record["prompt_tokens"],
            seed=10_000 * i + j,
            id=(i, j),
            stop_strings=stops,
            sampling=sampling,
        )
        for i, record in enumerate(records)
        for j in range(k)
    ]
    completions = generate_all(engine, params, requests, text_stream=tokenizer.text_stream)
    scores = np.asarray(
        runner.score(
            [(c.id, tokenizer.decode(c.tokens), records[c.id[0]]["answer"]) for c in completions],
            counted=False,
        )
    ).reshape(len(records), k)
    correct = scores >= 1.0
    return {"pass@1": float(correct.mean()), f"pass@{k}": float(correct.any(axis=1).mean())}


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
        "sampling": _sampling(config),
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
    generation mesh: evaluation, which runs before and after training, uses the training mesh
    (this process's part of it, with training hosts)."""
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
    dtype = _DTYPES[config.model.dtype]
    spec = hosts_lib.EngineSpec(
        model.config,
        config.seed,
        _engine_settings(config, eos_ids),
        devices=config.runtime.devices_per_instance,
        tp=config.runtime.instance_tp,
        model_kwargs={"param_dtype": PARAM_DTYPE, "dtype": dtype},
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
        raise ValueError(
            f"workdir {workdir!r}: a local directory is needed (mount a bucket with gcsfuse)"
        )
    start = time.perf_counter()
    group = start_training_hosts(config)
    try:
        return _train_and_evaluate(config, workdir, progress, group, start)
    finally:
        if group is not None:
            group.close()


def _train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    progress: bool | None,
    group: training_hosts_lib.Group | None,
    start: float,
) -> dict[str, Any]:
    settings = validate(config)
    os.makedirs(workdir, exist_ok=True)
    data = load_task(config)
    runner = reward_runner(config)
    checkpointer = _checkpointer(config, workdir)
    latest = checkpointer.latest_step()
    if latest is not None:  # before anything of the saved run is restored or cut back
        check_same_run(checkpointer.read_meta(latest).get("config"), config, workdir)
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
    iterator = iter(_prompt_dataset(config, data, data.train_rows))
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
    rl_seconds = time.perf_counter() - rl_start

    trained = trainer.params
    if pending_eval.get("eval/version") == trainer.version:  # scored at the last barrier
        after = {k.removeprefix("eval/"): v for k, v in pending_eval.items() if k != "eval/version"}
    else:
        after = held_out_of_trainer()
    runner.close()
    nnx.update(model, trained)
    models.save_pretrained(
        model,
        os.path.join(workdir, "hf_policy"),
        source=config.model.checkpoint or None,
        dtype=_DTYPES[config.model.dtype],  # what the engines ran (and `eval` scored)
    )
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
        "wall_time_s": time.perf_counter() - start,
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
    _check_workdir(workdir, "an existing directory without checkpoints evaluates the start")
    data = load_task(config)
    model = load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    engine = make_engines(config, model, settings.plan, data.tokenizer.eos_ids)[0]
    step, saved = _checkpoint_params(config, settings, workdir, model)
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
    _check_workdir(workdir, "a training run's workdir")
    data = load_task(config)
    model = load_policy(config, data.tokenizer.vocab_size, settings.plan.train_mesh)
    step, params = _checkpoint_params(config, settings, workdir, model, version)
    if step is None:
        raise FileNotFoundError(f"{workdir} holds no checkpoint to export")
    nnx.update(model, params)
    out = out or os.path.join(workdir, f"hf_policy_v{step}")
    models.save_pretrained(
        model, out, source=config.model.checkpoint or None, dtype=_DTYPES[config.model.dtype]
    )
    return out


def _check_workdir(workdir: str, expected: str) -> None:
    if not os.path.isdir(workdir):
        raise FileNotFoundError(
            f"--workdir={workdir} does not exist: name a training run's workdir ({expected})"
        )


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
    checkpointer = _checkpointer(config, workdir)
    try:
        steps = checkpointer.all_steps()
        if step is not None and step not in steps:
            raise ValueError(f"{workdir} has no checkpoint of version {step}; it has {steps}")
        step = step if step is not None else (steps[-1] if steps else None)
        if step is None:
            return None, None
        saved = checkpointer.read_meta(step).get("config")
        check_same_run(saved, config, workdir, prefixes=("model.",))
        _, params = models.Functional.of(model)
        shardings = sharding_lib.param_shardings(params, settings.plan.train_mesh)
        like = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings
        )
        return step, checkpointer.restore_params(step, like)
    finally:
        checkpointer.close()


# Fields a resumed run may change: where it runs, how long, what it evaluates and keeps. Any
# other difference (model, data, reward, sampling, rollout rules, trainer) would continue the
# saved run as another one, from a ledger cut back to the checkpoint.
_RESUMABLE_CHANGES = (
    "compilation_cache_dir", "num_cpu_devices", "rollout.num_iterations", "runtime.", "eval.",
    "checkpoint.", "sft.", "engine.slots", "reward.isolation", "reward.workers",
    "train.remat",  # what the backward keeps (same math, bfloat16 rounds apart): on after OOM
    "model.qk_norm",  # implied by model.architecture (ModelConfig refuses any other value)
)  # fmt: skip


# Run-defining fields added after checkpoints were saved without them, with the value that does
# what the code did before each existed: a run saved then goes on under a config stating it.
_ADDED_FIELDS: dict[str, Any] = {
    "reward.options": {},
    "engine.stop_strings": [],
    "train.entropy_coef": 0.0,
    "train.micro_batch_tokens": None,
    "train.epochs": 1,
}


def run_defining_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config's fields as {"section.field": value} (JSON values), less those a resumed
    run may change: saved with each checkpoint, compared on resume."""
    flat = {}
    for key, value in json.loads(config.to_json()).items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for field, v in items:
            name = key if field is None else f"{key}.{field}"
            if not name.startswith(_RESUMABLE_CHANGES):
                flat[name] = v
    return flat


def check_same_run(
    saved: dict[str, Any] | None,
    config: ml_collections.ConfigDict,
    workdir: str,
    prefixes: tuple[str, ...] = ("",),
) -> None:
    """Refuses to continue (or evaluate) the run saved in `workdir` under another config: a
    different model shape would fail deep in orbax, a different group size or mode would
    stall the resumed rollout after cutting the saved run's ledger back. Checkpoints from
    before configs were saved (`saved` None) are not checked."""
    if saved is None:
        return
    saved = {**_ADDED_FIELDS, **saved}
    now = run_defining_fields(config)
    differ = sorted(
        k
        for k in saved.keys() | now.keys()
        if k.startswith(prefixes)
        and not k.startswith(_RESUMABLE_CHANGES)  # a checkpoint may predate the exemption
        and saved.get(k) != now.get(k)
    )
    if differ:
        changes = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
        raise ValueError(
            f"{workdir} holds a run saved under another config ({changes}); continue it with "
            "the same settings, or start this one in a new workdir"
        )


# The reference only with a KL penalty, the TIS history only with `train.tis_cap`.
_TRAIN_ARRAYS = ("params", "opt_state", "reference", "tis_history")


def _train_arrays(state: dict[str, Any]) -> dict[str, Any]:
    """The array part of the trainer's state (the rest is counters, kept in the JSON meta)."""
    return {k: state[k] for k in _TRAIN_ARRAYS if k in state}


def _prompt_dataset(
    config: ml_collections.ConfigDict, data: TaskData, rows: Any, num_epochs: int | None = None
) -> Any:
    builtin = data.task is not None
    return prompt_dataset(
        rows,
        data.tokenizer,
        make_template(config.data.template, config.model.checkpoint or None),
        max_prompt_len=config.data.max_prompt_len,
        seed=config.seed,
        prompt_field="prompt" if builtin else config.data.prompt_field,
        answer_field="answer" if builtin else config.data.answer_field,
        on_bad_row=config.data.on_bad_row,
        num_epochs=num_epochs,
    )


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
