"""RolloutConfig: errors that name the field, and every field reachable from the command line."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from dora_jax.rollout import config_lib
from dora_jax.rollout.config_lib import RolloutConfig


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"mode": "async"}, "mode"),
        ({"train_batch_size": 6, "group_size": 4}, "train_batch_size"),
        ({"rollout_batch_size": 4, "train_batch_size": 8}, "rollout_batch_size"),
        ({"decode_steps_per_turn": 0}, "decode_steps_per_turn"),
        ({"decode_steps_per_turn": 2.5}, "decode_steps_per_turn"),
        ({"publish_delay_steps": -1}, "publish_delay_steps"),
        ({"kv_pressure": 1.5}, "kv_pressure"),
    ],
)
def test_impossible_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"rollout.{field}="):
        RolloutConfig(**overrides)


def test_a_config_section_refuses_the_run_seed_and_unknown_fields():
    with pytest.raises(ValueError, match="'seed'.*set it once"):
        config_lib.config_section(seed=3)
    with pytest.raises(ValueError, match="unknown field.*'steps'"):
        config_lib.config_section(steps=3)


# A value other than the default for every field a config file's `rollout` section holds.
_OVERRIDES = {
    "mode": "partial", "train_batch_size": 16, "rollout_batch_size": 48, "group_size": 8,
    "staleness_bound": 3, "num_iterations": 7, "timer_steps": 5, "kv_pressure": 0.5,
    "publish_delay_steps": 9, "decode_steps_per_turn": 4,
}  # fmt: skip


@pytest.mark.parametrize("config_file", ["default.py", "bench_longtail.py", "qwen3_gsm8k.py"])
def test_every_rollout_field_can_be_set_from_the_command_line(config_file):
    """ml_collections refuses an override of a key the config file lacks; every field must reach
    the rollout's config from `--config.rollout.FIELD=VALUE` (the bench picks each run's mode
    from `modes` and has no `rollout.mode`)."""
    settable = [f.name for f in dataclasses.fields(RolloutConfig)]
    assert sorted(_OVERRIDES) == sorted(set(settable) - set(config_lib.RUN_FIELDS))
    overrides = dict(_OVERRIDES)
    if config_file == "bench_longtail.py":
        del overrides["mode"]
    path = pathlib.Path(__file__).parents[2] / "configs" / config_file
    flags_given = [f"--config.rollout.{k}={v}" for k, v in overrides.items()]
    argv = ["prog", f"--config={path}", *flags_given]
    values = flags.FlagValues()
    # Overrides are found in the argv given when the flag is defined, as the CLI's sys.argv.
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    values(argv)
    built = RolloutConfig.from_dict({**values.config.rollout.to_dict(), "seed": 0})
    for name, value in overrides.items():
        assert getattr(built, name) == value, name
