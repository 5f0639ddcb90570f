"""The loss contract's one optional plan (issue 50): what a loss asks of the trainer beyond its
required members is a typed ``LossPlan``, read in one place; the members it replaced and the
``(loss, metrics)`` return of earlier versions are refused with the way to migrate."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from marin_rl_core import ExitCode, LossPlan, LossPlugin, build_registry
from marin_rl_core.protocols import loss_plan
from marin_rl_core.testing import check_plugin

OLD_LOSS = '''
import attrs
import numpy as np

from marin_rl_core import LossPlugin, hookimpl


@attrs.frozen
class OldConfig:
    coef: float = 1.0


class OldLoss:
    """A loss written for an earlier version: optional members on the module."""

    needs_reference_model = False
    aggregation = "sequence_mean"
    update_epochs = 2

    def __init__(self, config):
        self.config = config

    def build(self, reference_model):
        return self

    def compute_advantages(self, group):
        rewards = np.asarray(group.rewards, dtype=np.float64)
        return (rewards - rewards.mean()).astype(np.float32)

    def create_loss_fn(self, reference_model, train_model):
        raise AssertionError("never reached: the run is refused before it starts")


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(name="old", summary="An old-style loss.", config_class=OldConfig, build=OldLoss)
'''


def test_a_loss_with_members_the_plan_replaced_is_refused_before_the_run_starts(
    tmp_path, tiny_mock_job
):
    """``marinrl run --loss old``: exit 3 before anything is written, naming the members and
    the plan that replaces them (renames included), no traceback."""
    (tmp_path / "oldloss.py").write_text(OLD_LOSS)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--plugin", "oldloss", "--loss", "old",
         *tiny_mock_job, "--set", f'run_dir="{tmp_path / "runs"}"'],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    out = " ".join(result.stderr.split())
    assert result.returncode == ExitCode.CONFIG, result.stderr[-3000:]
    assert "the 'old' loss plugin's plan" in out, out
    assert "declares aggregation, update_epochs" in out, out
    assert "plan = marin_rl_core.LossPlan(aggregation=..., epochs=...)" in out, out
    assert "update_epochs -> epochs" in out and "docs/losses.md" in out, out
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for a refused run"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"epochs": 0}, "LossPlan.epochs is 0; it must be an int >= 1"),
        ({"minibatches": 1.5}, "LossPlan.minibatches is 1.5"),
        ({"frozen_policy_steps": -1}, "LossPlan.frozen_policy_steps is -1"),
        ({"aggregation": "mean"}, "use one of ('token_mean', 'sequence_mean', 'sum_over_length')"),
        ({"aggregation": ("sum_over_length", -4)}, "with a length of 0 or more"),
        ({"init_state": "critic"}, "LossPlan.init_state must be callable or None"),
        ({"state_learning_rate": 0.0}, "use a rate above 0"),
    ],
)
def test_a_plan_that_cannot_be_followed_says_which_field(fields, says):
    with pytest.raises(ValueError) as err:
        LossPlan(**fields)
    assert says in str(err.value)


def test_the_plan_is_read_from_one_optional_member():
    class Plain:
        needs_reference_model = False

    class Planned(Plain):
        plan = LossPlan(aggregation=("sum_over_length", 8), epochs=2, minibatches=3)

    class Wrong(Plain):
        plan = {"epochs": 2}

    assert loss_plan(Plain()) == LossPlan()
    plan = loss_plan(Planned())
    assert plan.updates_per_step == 6 and plan.aggregation == ("sum_over_length", 8)
    with pytest.raises(TypeError, match="Wrong's plan is a dict; make it a marin_rl_core.LossPlan"):
        loss_plan(Wrong())


class _TupleLoss:
    """A loss whose function returns ``(loss, metrics)``: the contract before issue 26."""

    needs_reference_model = False

    def __init__(self, config):
        self.config = config

    def build(self, reference_model):
        return self

    def compute_advantages(self, group):
        rewards = np.asarray(group.rewards, dtype=np.float64)
        return (rewards - rewards.mean()).astype(np.float32)

    def create_loss_fn(self, reference_model, train_model):
        from marin_rl_core import batch_logprobs_and_entropy

        def loss_fn(model, batch, *, key=None):
            logp = batch_logprobs_and_entropy(model, batch, key=key)[0].array
            mask = batch.loss_mask.array
            return -(logp * mask).sum() / mask.sum(), {}

        return loss_fn


def test_a_loss_function_returning_loss_and_metrics_fails_with_the_way_to_migrate():
    """In the contract check, and where the trainer calls it (``plugin_loss_fn``, traced in
    the step): both say to return a ``TokenLoss`` and where the migration is written."""
    import attrs
    import jax

    from marin_rl_core import step_loss
    from marin_rl_core.learner.step import plugin_loss_fn
    from marin_rl_core.testing import ArithmeticTokenizer, ModelConfig, build_model

    @attrs.frozen
    class Config:
        pass

    record = LossPlugin(name="tuple", summary="old return", config_class=Config, build=_TupleLoss)
    with pytest.raises(AssertionError, match="returned a tuple, not a TokenLoss"):
        check_plugin(record)

    from marin_rl_core import training_batch_from_rollouts
    from marin_rl_core.testing import _tiny_group

    group = _tiny_group([0.0, 1.0])
    batch = training_batch_from_rollouts(group.rollouts, np.array([-0.5, 0.5]), 8, 0)
    shape = ModelConfig(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=2, max_seq_len=8)  # fmt: skip
    model = build_model(shape, ArithmeticTokenizer(), key=jax.random.PRNGKey(0))
    trainer_fn = plugin_loss_fn(_TupleLoss(Config()))
    with pytest.raises(TypeError) as err:
        step_loss(lambda m, b, *, key=None: trainer_fn(m, b, key=key), model, batch)
    assert "not a marin_rl_core.TokenLoss" in str(err.value)
    assert 'plan = LossPlan(aggregation="sequence_mean")' in str(err.value)
    assert "Migrating a loss" in str(err.value)


def test_check_plugin_checks_the_plugin_built_with_a_given_config():
    """``ppo`` with a separate critic model, two epochs of two minibatches and whitening runs
    the plan's preparation in the check; a config of another class is refused."""
    from marin_rl_plugins.ppo import PPOConfig

    ppo = build_registry().get("loss", "ppo")
    config = PPOConfig(critic="model", epochs=2, minibatches=2, normalize_advantages=True)
    plan = ppo.build(config).plan
    assert plan.create_prepare_fn is not None and plan.updates_per_step == 4
    check_plugin(ppo, config)
    with pytest.raises(AssertionError, match="config must be a PPOConfig, got dict"):
        check_plugin(ppo, {"critic": "model"})
