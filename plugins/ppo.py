"""The ``ppo`` loss: PPO with a learned critic and GAE.

The critic is trainable loss state (``init_state``): trained with the policy at its own
learning rate, sharded and checkpointed with it, never published to rollout workers or exported.

* ``critic = "head"``: a linear value head on the policy's final hidden states. Cheap (one
  ``[embed]`` vector; the trunk's forward pass is shared) but the value loss's gradient flows
  into the policy's trunk, so value and policy learning interfere; ``vf_coef`` keeps it small.
* ``critic = "model"``: a separate copy of the policy's transformer with its own head (as Tunix
  does): twice the parameters, optimizer state and forward/backward work, no interference.

Per response token ``t`` (the tokens the policy sampled, in order, per rollout; rewards from
``TrainingBatch.token_rewards``: each turn's reward on its last token)::

    delta_t = r_t + gamma V_t' - V_t          A_t = delta_t + gamma lam A_t'     R_t = A_t + V_t
    l_t     = (policy-gradient objective with A_t)  +  vf_coef * 0.5 max((V_t - R_t)^2,
                                                         (clip(V_t, V_old - vf_clip, V_old + vf_clip) - R_t)^2)

``V`` in GAE is taken as a constant. The policy-gradient objective and its options
(:mod:`marin_rl_core.learner.policy_gradient`) apply. ``V_old`` is the critic's value before the
update: with one update per sampled batch (as now) the clipped and unclipped value losses agree
and ``vf_clipfrac`` is 0. ``normalize_advantages`` whitens ``A`` over each micro-batch's tokens
(the one step that depends on the micro-batching, off by default). The advantages computed as
rollouts arrive (reward minus the group's mean) only decide which groups the replay buffer
prefers; the loss uses GAE.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from marin_rl_core import LossPlugin, hookimpl, one_of
from marin_rl_core.learner.policy_gradient import PolicyGradientConfig, PolicyGradientLoss


@attrs.frozen(kw_only=True)
class PPOConfig(PolicyGradientConfig):
    """Args (and those of :class:`~marin_rl_core.learner.policy_gradient.PolicyGradientConfig`):
    gamma, lam: GAE's discount and its bias-variance trade-off.
    critic: ``"head"`` or ``"model"`` (module docstring).
    critic_learning_rate: the critic's peak learning rate; 0 uses ``trainer.learning_rate``.
    vf_coef: weight of the value loss.
    vf_clip: the value is clipped to within this of the critic's value before the update.
    normalize_advantages: whiten GAE's advantages over each micro-batch.
    """

    gamma: float = attrs.field(
        default=1.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )
    lam: float = attrs.field(
        default=0.95, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )
    critic: str = attrs.field(default="head", validator=one_of("head", "model"))
    critic_learning_rate: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    vf_coef: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))
    vf_clip: float = attrs.field(default=0.2, validator=attrs.validators.gt(0.0))
    normalize_advantages: bool = False
    kl_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))


class PPOLoss(PolicyGradientLoss):
    """Implements :class:`marin_rl_core.RLLossModule`; see the module docstring."""

    needs_token_rewards = True

    @property
    def state_learning_rate(self) -> float | None:
        return self.config.critic_learning_rate or None

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rewards - rewards.mean()  # the replay buffer's preference only (docstring)

    def init_state(self, policy: Any, *, key: Any) -> Any:
        import equinox as eqx
        import jax

        from marin_rl_core.learner.loss import Critic, ValueHead

        trunk = None
        if self.config.critic == "model":
            trunk = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, policy)
        return Critic(trunk=trunk, head=ValueHead.init(policy.Embed))

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Any:
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        from marin_rl_core.learner.loss import TokenLoss, as_named, gae, token_mean
        from marin_rl_core.learner.policy_gradient import policy_gradient_loss
        from marin_rl_core.learner.training_batch import (
            batch_hidden_states,
            batch_logprobs_and_entropy,
        )

        c = self.config
        if c.kl_coef > 0 and reference_model is None:
            raise ValueError("ppo with kl_coef > 0 needs the reference model; got None")
        sg = jax.lax.stop_gradient

        def loss_fn(model: Any, batch: Any, *, key: Any = None) -> Any:
            policy, critic = model.policy, model.loss_state
            if critic.trunk is None:
                logp, ent, hidden = batch_logprobs_and_entropy(
                    policy, batch, key=key, with_hidden=True
                )
            else:
                logp, ent = batch_logprobs_and_entropy(policy, batch, key=key)
                hidden = batch_hidden_states(critic.trunk, batch)
            values = critic.head(hidden)
            mask = batch.loss_mask.array
            segments = None if batch.segment_ids is None else batch.segment_ids.array
            advantages, returns = gae(
                batch.token_rewards.array, values, mask, segments, gamma=c.gamma, lam=c.lam
            )
            if c.normalize_advantages:
                mean = token_mean(advantages, mask)
                std = jnp.sqrt(token_mean(jnp.square(advantages - mean), mask))
                advantages = jnp.where(mask > 0, (advantages - mean) / (std + 1e-8), 0.0)
            pg_batch = eqx.tree_at(
                lambda b: b.advantages, batch, as_named(advantages, batch.advantages)
            )
            ref = None
            if c.kl_coef > 0:
                ref = sg(batch_logprobs_and_entropy(reference_model, batch)[0])
            out = policy_gradient_loss(c, pg_batch, logp, ent, ref)
            old = sg(values)
            clipped = old + jnp.clip(values - old, -c.vf_clip, c.vf_clip)
            unclipped_loss = jnp.square(values - returns)
            clipped_loss = jnp.square(clipped - returns)
            value_loss = 0.5 * jnp.maximum(unclipped_loss, clipped_loss)
            like = batch.loss_mask
            metrics = dict(out.metrics)
            metrics.update(
                value_loss=as_named(value_loss, like),
                vf_clipfrac=as_named((clipped_loss > unclipped_loss).astype(jnp.float32), like),
                value_mean=as_named(values, like),
                return_mean=as_named(returns, like),
                advantage_mean=as_named(advantages, like),
            )
            return TokenLoss(
                loss=out.loss + c.vf_coef * as_named(value_loss, like),
                metrics=metrics,
                scalars=out.scalars,
            )

        return loss_fn


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(
        name="ppo",
        summary="PPO: a learned critic (value head or separate model), GAE, clipped value loss.",
        config_class=PPOConfig,
        build=PPOLoss,
    )
