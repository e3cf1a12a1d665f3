"""One definition of a count, kept by every config and constructor that takes one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ml_collections import ConfigDict

from dora_jax.config_fields_lib import as_integer, check_integer_fields, is_count
from dora_jax.rollout.config_lib import RolloutConfig
from dora_jax.runtime import cpu_cores_lib, cpu_flags_lib, devices_lib
from dora_jax.train.config_lib import TrainConfig


@given(st.integers(-(2**40), 2**40), st.integers(-5, 5))
def test_integers_of_every_kind_are_integers_but_only_python_ints_are_counts(value, least):
    for kind in (int, np.int32, np.int64):
        if kind is np.int32 and not -(2**31) <= value < 2**31:
            continue
        assert as_integer(kind(value)) == value
    assert is_count(value, least) == (value >= least)
    assert not is_count(np.int64(value), least)  # passes checks, then fails to write as JSON


@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, np.float32(3), "3", None, [1]])
def test_bools_floats_and_strings_are_not(value):
    assert as_integer(value) is None and not is_count(value, 0)


@pytest.mark.parametrize("value", [True, 2.0])
def test_every_check_refuses_what_is_not_a_count(value):
    """`True` passed as 1 and a whole float passed as an int in some of these, each of which
    had its own test of "a positive integer"."""
    with pytest.raises(ValueError, match="num_iterations"):
        RolloutConfig(num_iterations=value)
    with pytest.raises(ValueError, match="mini_batches"):
        TrainConfig(mini_batches=value)
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(warmup_steps=value)
    with pytest.raises(ValueError, match="engine.slots"):
        check_integer_fields(ConfigDict({"engine": {"slots": value}}), {"engine.slots": 1})
    with pytest.raises(ValueError, match="num_instances"):
        devices_lib.plan_devices(train_devices=1, num_instances=value)
    with pytest.raises(ValueError, match="num_cpu_devices"):
        cpu_flags_lib.use_cpu_devices(value)
    with pytest.raises(ValueError, match="train_cpu_cores"):
        cpu_cores_lib.split(value, field="runtime.train_cpu_cores")
