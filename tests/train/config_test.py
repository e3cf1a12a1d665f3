"""TrainConfig: building from ml_collections and errors that name the field."""

from __future__ import annotations

import dataclasses
import pathlib

import ml_collections
import pytest

from dora_jax.train import TrainConfig


def test_from_config_dict():
    cfg = ml_collections.ConfigDict(
        {"tbs": 8, "group_size": 4, "loss": "triplet", "length_buckets": [16, 64]}
    )
    config = TrainConfig.from_dict(cfg)
    assert (config.tbs, config.loss, config.length_buckets) == (8, "triplet", (16, 64))
    with pytest.raises(ValueError, match="unknown field.*'tbz'"):
        TrainConfig.from_dict(ml_collections.ConfigDict({"tbz": 8}))


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"tbs": 10, "group_size": 4}, "tbs"),
        ({"tbs": 8, "group_size": 4, "mini_batches": 3}, "mini_batches"),
        ({"tbs": 8, "group_size": 4, "mini_batches": 2, "micro_batch_size": 3}, "micro_batch_size"),
        ({"schedule": "linear"}, "schedule"),
        ({"remat": "minimal"}, "remat"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
        ({"aggregation": "seq_sum_over_const"}, "t_max"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"tis_cap": 2.0}, "max_staleness"),
        ({"tis_cap": -1.0, "max_staleness": 1}, "tis_cap"),
        ({"length_buckets": (64, 32)}, "length_buckets"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),  # a floor at or above the surrogate
        ({"advantage": "rloo", "tbs": 4, "group_size": 1}, "group_size"),
        ({"advantage": "grpo", "tbs": 4, "group_size": 1}, "group_size"),  # no signal at all
    ],
)
def test_impossible_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^train\.{field}: "):
        TrainConfig(**overrides)


# A value other than the default for every field a config file's `train` section holds.
_OVERRIDES = {
    "mini_batches": 4, "epochs": 2, "micro_batch_size": 8, "micro_batch_tokens": 4096,
    "length_buckets": (16, 64), "learning_rate": 3e-4,
    "warmup_steps": 5, "schedule": "cosine", "decay_steps": 50, "min_learning_rate_ratio": 0.1,
    "weight_decay": 0.01, "adam_b1": 0.8, "adam_b2": 0.99, "adam_eps": 1e-6,
    "max_grad_norm": 0.5, "advantage": "rloo", "advantage_eps": 1e-5, "loss": "gspo",
    "eps_low": 0.1, "eps_high": 0.3, "eps_neg_low": 0.3, "eps_neg_high": 3.0,
    "eps_pos_high": 0.4, "clip_ratio_c": 5.0, "tis_cap": 2.0, "kl_coef": 0.05,
    "aggregation": "seq_sum_over_const",
    "t_max": 512, "mask_truncated": True, "max_skipped_steps": 3, "remat": "dots",
    "entropy_coef": 0.01,
}  # fmt: skip


@pytest.mark.parametrize("config_file", ["default.py", "bench_longtail.py", "qwen3_gsm8k.py"])
def test_every_trainer_field_can_be_set_from_the_command_line(config_file):
    """ml_collections refuses an override of a key the config file lacks; every field the
    README documents must reach the trainer's config from `--config.train.FIELD=VALUE`."""
    from absl import flags
    from ml_collections import config_flags

    from dora_jax.rollout.config_lib import RolloutConfig, train_config
    from dora_jax.train import config_lib

    settable = [f.name for f in dataclasses.fields(TrainConfig)]
    elsewhere = config_lib.ROLLOUT_FIELDS + config_lib.ENGINE_FIELDS
    settable = [name for name in settable if name not in elsewhere]
    assert sorted(_OVERRIDES) == sorted(settable)
    path = pathlib.Path(__file__).parents[2] / "configs" / config_file
    argv = ["prog", f"--config={path}", *(f"--config.train.{k}={v}" for k, v in _OVERRIDES.items())]
    values = flags.FlagValues()
    # Overrides are found in the argv given when the flag is defined, as the CLI's sys.argv.
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    values(argv)
    config = values.config
    rollout = RolloutConfig.from_dict({**config.rollout.to_dict(), "seed": 0})
    built = train_config(rollout, config.train, config.engine.temperature)
    for name, value in _OVERRIDES.items():
        assert getattr(built, name) == value, name


def test_a_config_section_refuses_the_rollouts_fields_and_unknown_ones():
    from dora_jax.train import config_lib

    with pytest.raises(ValueError, match="'tbs'.*rollout"):
        config_lib.config_section(tbs=8)
    with pytest.raises(ValueError, match="'temperature'.*engine.temperature"):
        config_lib.config_section(temperature=0.7)
    with pytest.raises(ValueError, match="unknown field.*'tbz'"):
        config_lib.config_section(tbz=8)
