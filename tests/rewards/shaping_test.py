"""DAPO's soft overlong punishment against the paper's piecewise definition, written apart."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora_jax.rewards.shaping_lib import OverlongPenalty


def _dapo_reference(length: int, l_max: int, l_cache: int, factor: float) -> float:
    """DAPO eq. 13, scaled by `factor`: 0 up to L_max - L_cache, then ((L_max - L_cache) - |y|)
    / L_cache up to L_max, -1 past it."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return factor * ((l_max - l_cache) - length) / l_cache
    return -factor


@given(
    l_max=st.integers(1, 4096),
    data=st.data(),
    factor=st.floats(0.0, 10.0, allow_nan=False),
)
def test_matches_the_papers_definition(l_max, data, factor):
    l_cache = data.draw(st.integers(1, l_max))
    length = data.draw(st.integers(0, 2 * l_max))
    penalty = OverlongPenalty(l_max, l_cache, factor)(length)
    np.testing.assert_allclose(
        penalty, _dapo_reference(length, l_max, l_cache, factor), rtol=1e-12, atol=1e-12
    )


def test_known_values():
    penalty = OverlongPenalty(max_length=100, buffer=20, factor=0.5)
    assert [penalty(n) for n in (0, 80, 81, 90, 100)] == [0.0, 0.0, -0.025, -0.25, -0.5]


def test_a_zero_buffer_is_off():
    penalty = OverlongPenalty(max_length=8, buffer=0)
    assert [penalty(n) for n in range(10)] == [0.0] * 10


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"buffer": -1}, "reward.overlong_buffer"),
        ({"buffer": 9}, "reward.overlong_buffer"),
        ({"buffer": 4, "factor": -0.1}, "reward.overlong_penalty"),
        ({"buffer": 4, "factor": float("nan")}, "reward.overlong_penalty"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OverlongPenalty(max_length=8, **kwargs)
