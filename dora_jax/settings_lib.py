"""The run's configuration, checked whole before any heavy work, and the run's identity.

`validate` turns a config into `Settings` or fails naming the field; the small `config ->
object` helpers here (sampling, stop strings, the reward runner, the built-in task) are the one
place each field is read. A checkpoint saves `run_defining_fields`, and `check_same_run`
refuses to continue or evaluate it under a config that would make it another run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import traceback
import types
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from dora_jax import models
from dora_jax.config_fields_lib import ConfigError, check_integer_fields, check_timeout
from dora_jax.data import BAD_ROW_MODES, LongTailTask, file_list, make_template, prompt_tokens
from dora_jax.engine import SamplingParams
from dora_jax.models import lora_lib
from dora_jax.rewards import RewardRunner, get_reward
from dora_jax.rewards.shaping_lib import OverlongPenalty
from dora_jax.rollout.config_lib import RolloutConfig, train_config
from dora_jax.runtime import hosts_lib
from dora_jax.runtime.devices_lib import DevicePlan, plan_devices
from dora_jax.train.config_lib import TrainConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MODEL_SHAPE_FIELDS = {
    f.name for f in dataclasses.fields(models.ModelConfig) if f.name not in ("vocab_size",)
}


def model_shape(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A random init's `ModelConfig` fields from `config.model`, all but the vocabulary (the
    tokenizer's)."""
    return {k: v for k, v in config.model.items() if k in MODEL_SHAPE_FIELDS}


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
    "model": frozenset(
        {"checkpoint", "dtype", "lora_rank", "lora_alpha", "lora_targets", *MODEL_SHAPE_FIELDS}
    ),
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
    """Checks the whole config before any heavy work; errors (`ConfigError`) name the
    offending field."""
    try:
        return _validate(config)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        if not _raised_by_dora_jax(e):
            raise  # a bug in user code the config names (a reward module): its traceback
        raise ConfigError(str(e)) from e


def _raised_by_dora_jax(e: BaseException) -> bool:
    """Whether `e` comes from this package's own checks, which name the field they refuse,
    rather than from code they call into (a user's reward module, a library)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _validate(config: ml_collections.ConfigDict) -> Settings:
    _check_field_names(config)
    _check_number_types(config)
    if config.model.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r}: expected one of {list(DTYPES)}")
    if config.data.source not in ("longtail", "files"):
        raise ValueError(f"data.source={config.data.source!r}: expected 'longtail' or 'files'")
    if config.data.source == "files" and not file_list(config.data.train_files):
        raise ValueError(
            f"data.train_files={config.data.train_files!r} must name at least one file when "
            "data.source='files'"
        )
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
    if not config.model.checkpoint:  # a checkpoint's shape is its config.json's
        # The vocabulary is the tokenizer's, known once the task is loaded.
        _named("model.", lambda: models.ModelConfig(vocab_size=1, **model_shape(config)))
    if lora_config(config) is not None and not config.model.checkpoint:
        # The adapters are all that trains; a random base's frozen head and norms cap its logits
        # near uniform (the default task at rank 8: warm-up cross-entropy 3.13, uniform 3.97,
        # and 0% held-out; BENCHMARKS.md).
        logging.warning(
            "model.lora_rank=%d on a random init (model.checkpoint is empty): LoRA adapts a "
            "pretrained model; a random base barely learns through adapters",
            config.model.lora_rank,
        )
    if config.eval.every and not config.checkpoint.every:
        raise ValueError(
            f"eval.every={config.eval.every} needs checkpoint.every > 0: held-out evaluation "
            "runs at checkpoint barriers, where the trainer's params are at rest (or set 0)"
        )
    _named("engine.", lambda: engine_sampling(config))
    _named("eval.", lambda: eval_sampling(config))
    stop_strings(config)
    if config.data.template == "chat" and not config.model.checkpoint:
        raise ValueError(
            "data.template='chat' needs model.checkpoint: the chat template is the checkpoint's"
        )
    if config.data.template != "chat":  # a chat template is the checkpoint's, checked on load
        _named("data.template: ", lambda: make_template(config.data.template))
    if config.data.source == "longtail":
        task = longtail_task(config)  # its errors name their task.* field
        if config.data.template != "chat":
            _check_builtin_prompt_length(config, task)
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "seed": config.seed})
    train = train_config(rollout, config.train, config.engine.temperature)
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


def check_inputs(config: ml_collections.ConfigDict) -> None:
    """Refuses a run whose `model.checkpoint` is no model directory, or one whose positions its
    prompts and responses would exceed, before it writes anything:
    a valid config may name a directory of another machine (a recipe's), so `validate` cannot.
    Data files are refused by field where they are opened (`task_lib.load_task`), also before
    the workdir is made."""
    checkpoint = config.model.checkpoint
    if not checkpoint:
        return
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ConfigError(
            f"model.checkpoint={checkpoint!r}: not a Hugging Face model directory "
            "(it has no config.json)"
        )
    try:
        with open(os.path.join(checkpoint, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (ValueError, AttributeError) as e:  # not JSON, or JSON but not an object
        raise ConfigError(
            f"model.checkpoint={checkpoint!r}: its config.json is no JSON object ({e})"
        ) from e
    longest = config.data.max_prompt_len + config.engine.max_decode_length
    if positions is not None and longest > positions:
        raise ConfigError(
            f"engine.max_decode_length={config.engine.max_decode_length}: with "
            f"data.max_prompt_len={config.data.max_prompt_len} a sequence reaches {longest} "
            f"positions, past model.checkpoint's max_position_embeddings={positions} (as vLLM "
            "refuses a max_model_len past it)"
        )
    if config.data.source == "files" and not os.path.isfile(
        os.path.join(checkpoint, "tokenizer.json")
    ):
        raise ConfigError(
            f"model.checkpoint={checkpoint!r} has no tokenizer.json, which tokenizes "
            "data.source='files' prompts"
        )
    if config.data.template == "chat":
        try:
            make_template("chat", checkpoint)
        except ValueError as e:
            raise ConfigError(f"data.template='chat': {e}") from e


# Numeric fields outside the `train` and `rollout` sections, whose dataclasses type theirs: a
# config file's `"1.0"` (a string) failed a comparison deep in a library, naming no field.
_NUMBER_FIELDS = {
    "seed": int,
    "engine.temperature": float,
    "engine.top_k": int,
    "engine.top_p": float,
    "eval.temperature": float | None,
    "eval.top_k": int | None,
    "eval.top_p": float | None,
    "reward.timeout_s": float,
    "runtime.host_timeout_s": float,
}


def _check_number_types(config: ml_collections.ConfigDict) -> None:
    """Refuses a number field holding anything but a number (an integer field, a non-integer),
    naming it. A bool is no number here, as it is no count (`config_fields_lib`)."""
    expected = dict(_NUMBER_FIELDS)
    for section, cls in (("train", TrainConfig), ("rollout", RolloutConfig)):
        hints = typing.get_type_hints(cls)
        expected.update({f"{section}.{name}": kind for name, kind in hints.items()})
    for field, kind in expected.items():
        section, _, name = field.rpartition(".")
        values = config.get(section, {}) if section else config
        if name not in values:
            continue
        value, kinds = values[name], set(typing.get_args(kind)) or {kind}
        if not kinds <= {int, float, types.NoneType} or (value is None and types.NoneType in kinds):
            continue
        numeric = not isinstance(value, bool) and isinstance(value, int | float)
        if int in kinds and not (numeric and isinstance(value, int)):
            raise ValueError(f"{field}={value!r}: must be an integer")
        if float in kinds and not numeric:
            raise ValueError(f"{field}={value!r}: must be a number")


def _check_field_names(config: ml_collections.ConfigDict) -> None:
    if {"modes", "workload"} <= set(config):
        raise ValueError(
            "this is a bench config (it has `modes` and a `workload`): run it with "
            "`dora-jax bench`; `dora-jax train` runs a training config, e.g. configs/default.py"
        )
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


def lora_config(config: ml_collections.ConfigDict) -> models.LoRAConfig | None:
    """The policy's adapters (`model.lora_rank` > 0), or None: every weight trains."""
    m = config.model
    rank, alpha = m.get("lora_rank", 0), m.get("lora_alpha", 16.0)
    targets = m.get("lora_targets", ",".join(lora_lib.TARGETS))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"model.lora_rank={rank!r}: expected an integer >= 0 (0: no LoRA)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"model.lora_alpha={alpha!r}: expected a number > 0")
    names = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else ()
    if not names or not set(names) <= set(lora_lib.TARGETS):
        raise ValueError(
            f"model.lora_targets={targets!r}: expected comma-separated projections among "
            f"{','.join(lora_lib.TARGETS)}"
        )
    if rank == 0:
        return None
    return models.LoRAConfig(rank=rank, alpha=float(alpha), targets=names)


def engine_sampling(config: ml_collections.ConfigDict) -> SamplingParams:
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


def _check_builtin_prompt_length(config: ml_collections.ConfigDict, task: LongTailTask) -> None:
    """The built-in task's prompts all have one length: too long for `data.max_prompt_len`,
    every one would be skipped, found only after the warm-up."""
    template = make_template(config.data.template)
    tokens = prompt_tokens(task.tokenizer(), template, task.problem(0, 1, 1)["prompt"])
    if len(tokens) > config.data.max_prompt_len:
        raise ValueError(
            f"data.max_prompt_len={config.data.max_prompt_len}: the built-in task's prompts "
            f"take {len(tokens)} tokens (with data.template)"
        )


def longtail_task(config: ml_collections.ConfigDict) -> LongTailTask:
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


def reward_runner(config: ml_collections.ConfigDict) -> RewardRunner:
    """The task's reward under the runner's timeout, in worker processes (`reward.isolation`)."""
    r = config.reward
    fn = get_reward(r.name, **r.options.to_dict())  # its errors name reward.name / .options
    return _named(
        "reward.",
        lambda: RewardRunner(fn, timeout_s=r.timeout_s, workers=r.workers, isolation=r.isolation),
    )


# -- the run's identity -------------------------------------------------------------------------

# Fields a resumed run may change: where it runs, how long, what it evaluates and keeps. Any
# other difference (model, data, reward, sampling, rollout rules, trainer) would continue the
# saved run as another one, from a ledger cut back to the checkpoint.
_RESUMABLE_CHANGES = (
    "compilation_cache_dir", "num_cpu_devices", "rollout.num_iterations", "runtime.", "eval.",
    "checkpoint.", "sft.", "engine.slots", "reward.isolation", "reward.workers",
    "train.remat",  # what the backward keeps (same math, bfloat16 rounds apart): on after OOM
    "model.qk_norm",  # implied by model.architecture (ModelConfig refuses any other value)
    # A run stopped by a bad row under "error" goes on under "skip": every row it read before
    # was good, so its prompts so far are the same either way.
    "data.on_bad_row",
)  # fmt: skip


# Run-defining fields added after checkpoints were saved without them, with the value that does
# what the code did before each existed: a run saved then goes on under a config stating it.
_ADDED_FIELDS: dict[str, Any] = {
    "reward.options": {},
    "engine.stop_strings": [],
    "train.entropy_coef": 0.0,
    "train.micro_batch_tokens": None,
    "train.epochs": 1,
    "model.lora_rank": 0,
    "model.lora_alpha": 16.0,
    "model.lora_targets": ",".join(lora_lib.TARGETS),
}


# Fields naming files (comma-separated lists for data): a run is defined by the files, not by
# how a command spelled them, so a job relaunched from another directory, or naming them by an
# absolute path, continues.
_PATH_FIELDS = ("model.checkpoint", "data.train_files", "data.heldout_files")


def _comparable(name: str, value: Any) -> Any:
    """A run-defining value as it defines the run: LoRA's targets are a set of projections,
    so `"v_proj,q_proj"` continues a run saved with `"q_proj, v_proj"`; paths are resolved
    (saved ones already are, but for checkpoints from before)."""
    if name == "model.lora_targets" and isinstance(value, str):
        return sorted({t.strip() for t in value.split(",")})
    if name in _PATH_FIELDS and isinstance(value, str):
        return ",".join(os.path.realpath(path) for path in file_list(value))
    return value


def _unused(config: ml_collections.ConfigDict) -> set[str]:
    """Fields the config holds that do not define this run: with `model.checkpoint` set, the
    shape fields (the checkpoint's config.json gives the shape)."""
    return {f"model.{f}" for f in MODEL_SHAPE_FIELDS} if config.model.checkpoint else set()


def run_defining_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config's fields as {"section.field": value} (JSON values), less those a resumed
    run may change and those it does not use: saved with each checkpoint, compared on resume."""
    flat = {}
    unused = _unused(config)
    for key, value in json.loads(config.to_json()).items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for field, v in items:
            name = key if field is None else f"{key}.{field}"
            if not (name.startswith(_RESUMABLE_CHANGES) or name in unused):
                flat[name] = _comparable(name, v) if name in _PATH_FIELDS else v
    return flat


def check_same_run(
    saved: dict[str, Any] | None,
    config: ml_collections.ConfigDict,
    workdir: str,
    prefixes: tuple[str, ...] = ("",),
    exempt: tuple[str, ...] = (),
    advice: str = "continue it with the same settings, or start this one in a new workdir",
) -> None:
    """Refuses to continue (or evaluate) the run saved in `workdir` under another config: a
    different model shape would fail deep in orbax, a different group size or mode would
    stall the resumed rollout after cutting the saved run's ledger back. Only fields under
    `prefixes` are compared, except those in `exempt`; `advice` says what to do instead.
    Checkpoints from before configs were saved (`saved` None) are not checked."""
    if saved is None:
        return
    unused = _unused(config)
    saved = {k: v for k, v in {**_ADDED_FIELDS, **saved}.items() if k not in unused}
    now = run_defining_fields(config)
    differ = sorted(
        k
        for k in saved.keys() | now.keys()
        if k.startswith(prefixes)
        and k not in exempt
        and not k.startswith(_RESUMABLE_CHANGES)  # a checkpoint may predate the exemption
        and _comparable(k, saved.get(k)) != _comparable(k, now.get(k))
    )
    if differ:
        changes = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
        raise ConfigError(f"{workdir} holds a run saved under another config ({changes}); {advice}")
