"""The learning-rate schedule the trainer's optimizer follows (``trainer.lr_schedule``)."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.learner.step import make_schedule


def config(*overrides: str):
    return resolve_config(
        build_registry(),
        selections={"loss": "rloo", "env": "math"},
        overrides=["trainer.num_train_steps=105", "trainer.warmup_steps=5", *overrides],
    )


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_warmup_then_decay_to_the_floor(kind):
    schedule = make_schedule(
        config(f'trainer.lr_schedule="{kind}"', "trainer.min_lr_ratio=0.1").trainer
    )
    lrs = [float(schedule(i)) for i in range(106)]
    assert lrs[0] == pytest.approx(2e-4)  # warmup starts at peak / warmup_steps
    assert lrs[5] == pytest.approx(1e-3)  # the peak, once warmed up
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))  # then never rises
    assert lrs[105] == pytest.approx(1e-4)  # and ends at min_lr_ratio * peak
    middle = lrs[55]
    assert middle == pytest.approx(5.5e-4, rel=1e-3)  # both are halfway at the midpoint


def test_constant_keeps_the_peak():
    schedule = make_schedule(config('trainer.lr_schedule="constant"').trainer)
    assert [float(schedule(i)) for i in (5, 50, 105)] == pytest.approx([1e-3] * 3)


def test_an_unknown_schedule_names_the_choices():
    with pytest.raises(ConfigError, match=r"lr_schedule.*cosine, linear"):
        config('trainer.lr_schedule="cosin"')
