"""The reward plot's smoothing: the train curve users follow is a running mean of batch rewards."""

from __future__ import annotations

import pytest

from marin_rl_core.report import _running_mean


def test_running_mean_averages_the_last_window_values():
    assert _running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]


def test_running_mean_uses_what_there_is_at_the_start():
    values = [0.0, 1.0, 0.0, 1.0]
    assert _running_mean(values, 10) == pytest.approx([0.0, 0.5, 1 / 3, 0.5])
