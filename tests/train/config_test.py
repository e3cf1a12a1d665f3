"""TrainConfig: building from ml_collections and errors that name the field."""

from __future__ import annotations

import ml_collections
import pytest

from dora_jax.train import TrainConfig


def test_from_config_dict():
    cfg = ml_collections.ConfigDict(
        {"tbs": 8, "group_size": 4, "loss": "triplet", "length_buckets": [16, 64]}
    )
    config = TrainConfig.from_config(cfg)
    assert (config.tbs, config.loss, config.length_buckets) == (8, "triplet", (16, 64))
    with pytest.raises(ValueError, match="unknown field.*'tbz'"):
        TrainConfig.from_config(ml_collections.ConfigDict({"tbz": 8}))


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"tbs": 10, "group_size": 4}, "tbs"),
        ({"tbs": 8, "group_size": 4, "mini_batches": 3}, "mini_batches"),
        ({"tbs": 8, "group_size": 4, "mini_batches": 2, "micro_batch_size": 3}, "micro_batch_size"),
        ({"schedule": "linear"}, "schedule"),
        ({"aggregation": "seq_sum_over_const"}, "t_max"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"tis_cap": 2.0}, "max_staleness"),
        ({"tis_cap": -1.0, "max_staleness": 1}, "tis_cap"),
        ({"length_buckets": (64, 32)}, "length_buckets"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"advantage": "rloo", "tbs": 4, "group_size": 1}, "group_size"),
    ],
)
def test_impossible_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        TrainConfig(**overrides)
