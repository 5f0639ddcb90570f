"""``reinforce``: an example third-party marinrl loss, written against the loss contract directly.

Advantages: each rollout's reward minus its group's mean. Loss, per response token ``t``::

    w_t = sg(min(exp(logp_t - b_t), max_weight))      # a capped importance weight (b: sampler)
    l_t = -w_t * A * logp_t  -  entropy_coef * H_t

returned per token as a :class:`~marin_rl_core.learner.loss.TokenLoss`; the framework weighs the
tokens by its plan's ``aggregation`` over the whole step (each rollout's tokens averaged, then the
rollouts: ``"sequence_mean"`` here), whatever the micro-batching. Try it::

    pip install ./examples/marinrl-reinforce
    marinrl run --env math --loss reinforce
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from marin_rl_core import LossPlan, LossPlugin, RolloutGroup, hookimpl


@attrs.frozen(kw_only=True)
class ReinforceConfig:
    """Args:
    max_weight: the importance weight (policy now / the sampler) is capped here.
    entropy_coef: weight of the entropy bonus.
    """

    max_weight: float = attrs.field(default=2.0, validator=attrs.validators.ge(1.0))
    entropy_coef: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))


class ReinforceLoss:
    """A :class:`marin_rl_core.RLLossModule`."""

    # What the loss asks of the trainer beyond the required members: here only how the
    # framework weighs the per-token losses (one update per step, no state of its own).
    plan = LossPlan(aggregation="sequence_mean")
    needs_reference_model = False  # no KL term: the trainer keeps no reference copy

    def __init__(self, config: ReinforceConfig):
        self.config = config

    def build(self, reference_model: Any) -> ReinforceLoss:
        return self

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        rewards = np.asarray(group.rewards, dtype=np.float64)
        return (rewards - rewards.mean()).astype(np.float32)

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Any:
        import jax
        import jax.numpy as jnp

        from marin_rl_core import TokenLoss, as_named, batch_logprobs_and_entropy

        max_weight, entropy_coef = self.config.max_weight, self.config.entropy_coef

        def loss_fn(model: Any, batch: Any, *, key: Any = None) -> TokenLoss:
            logprobs, entropy = batch_logprobs_and_entropy(model, batch, key=key)
            logp = logprobs.array
            weight = jax.lax.stop_gradient(
                jnp.minimum(jnp.exp(logp - batch.behaviour_logprobs.array), max_weight)
            )
            per_token = -weight * batch.advantages.array * logp - entropy_coef * entropy.array
            return TokenLoss(
                loss=as_named(per_token, batch.loss_mask),
                metrics={
                    "importance_weight": as_named(weight, batch.loss_mask),
                    "entropy": entropy,
                },  # fmt: skip
                scalars={"num_tokens": jnp.sum(batch.loss_mask.array)},
            )

        return loss_fn


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(
        name="reinforce",
        summary="REINFORCE with a group-mean baseline and a capped importance weight (example).",
        config_class=ReinforceConfig,
        build=ReinforceLoss,
    )
