"""The learning-rate schedule the trainer's optimizer follows (``trainer.lr_schedule``)."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.learner.optimizer import make_schedule


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


def test_several_updates_per_step_stretch_the_schedule_and_a_frozen_start_delays_it():
    """A loss making 4 updates per trainer step (PPO's epochs x minibatches) follows the same
    curve over 4x the updates; with the policy frozen for the first steps (value pretraining)
    its rate is 0 there, and its warmup and decay start after them and end with the run."""
    t = config('trainer.lr_schedule="linear"', "trainer.min_lr_ratio=0.1").trainer
    plain = make_schedule(t)
    stretched = make_schedule(t, updates_per_step=4)
    for step in (5, 40, 77, 105):  # after the warmup (which ramps in finer steps)
        assert float(stretched(4 * step)) == pytest.approx(float(plain(step)), rel=1e-5)
    frozen = make_schedule(t, updates_per_step=4, frozen_updates=8)
    assert [float(frozen(i)) for i in range(8)] == [0.0] * 8
    assert float(frozen(8)) == pytest.approx(1e-3 / 20)  # warmup: 5 steps x 4 updates
    assert float(frozen(8 + 20)) == pytest.approx(1e-3)
    assert float(frozen(105 * 4)) == pytest.approx(1e-4)  # the floor at the run's end
