"""The example loss's own tests, as its author runs them (pytest in this directory, the package
installed): the contract checks marinrl ships, and the loss against numpy."""

from __future__ import annotations

import marinrl_reinforce
import numpy as np
import pytest

from marin_rl_core import Rollout, RolloutGroup
from marin_rl_core.testing import check_plugin


def test_the_plugin_honours_the_loss_contract(plugin_registry):
    registry = plugin_registry(marinrl_reinforce)
    assert registry.names("loss") == ["reinforce"]
    check_plugin(registry.get("loss", "reinforce"))


def test_the_loss_is_minus_the_weighted_advantage_times_logp_averaged_per_rollout():
    import jax

    from marin_rl_core import (
        batch_logprobs_and_entropy,
        step_loss,
        training_batch_from_rollouts,
    )
    from marin_rl_core.testing import ArithmeticTokenizer, ModelConfig, build_model

    rollouts = [
        Rollout.single_turn(env_name="e", lesson_id="l", problem_id="p", prompt_tokens=[1, 2],
                            response_tokens=[3] * n, response_logprobs=[-3.0] * n, reward=r)
        for n, r in ((1, 1.0), (3, 0.0))
    ]  # fmt: skip
    loss = marinrl_reinforce.ReinforceLoss(marinrl_reinforce.ReinforceConfig())
    advantages = loss.compute_advantages(RolloutGroup(rollouts=rollouts))
    assert advantages.tolist() == [0.5, -0.5]
    batch = training_batch_from_rollouts(
        rollouts, advantages, 8, 0, aggregation=loss.plan.aggregation
    )
    config = ModelConfig(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, max_seq_len=8)  # fmt: skip
    model = build_model(config, ArithmeticTokenizer(), key=jax.random.PRNGKey(0))
    value, metrics = step_loss(loss.create_loss_fn(None, model), model, batch)

    logp = np.asarray(batch_logprobs_and_entropy(model, batch)[0].array, dtype=np.float64)
    mask = np.asarray(batch.loss_mask.array)
    weight = np.minimum(np.exp(logp + 3.0), 2.0)
    per_token = -weight * np.asarray(batch.advantages.array) * logp
    # Sequence mean: each rollout's token mean (one row each here), then the rollouts' mean.
    want = np.mean([(per_token[i] * mask[i]).sum() / mask[i].sum() for i in range(2)])
    assert float(value) == pytest.approx(want, rel=1e-5)
    assert float(metrics["num_tokens"]) == 4
