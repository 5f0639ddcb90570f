"""The ``ppo`` loss: PPO with a learned critic and GAE.

The critic is trainable loss state (the plan's ``init_state``;
:mod:`marin_rl_plugins.ppo_critic`): trained with the policy at its own learning rate, sharded
and checkpointed with it, never published to rollout workers or exported.

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
(:mod:`marin_rl_core.learner.policy_gradient`) apply; its importance ratio is taken against the
sampler's log-probabilities. The advantages computed as rollouts arrive (reward minus the
group's mean) only decide which groups the replay buffer prefers; the loss uses GAE.

Several updates per batch: with ``epochs`` or ``minibatches`` above 1, each trainer step first
computes the critic's values ``V_old`` on the whole batch, and from them GAE's ``A`` and ``R``,
once (the loss's preparation, ``TrainingBatch.prepared``); it then makes ``epochs`` passes over
the batch cut into ``minibatches`` (a random partition, the same for every epoch, visited in a
new random order each epoch after the first), one optimizer update each. The value is clipped to
within ``vf_clip`` of ``V_old`` (``vf_clipfrac``: how often that binds). With one update per
batch, ``V_old`` is the value itself and no preparation pass runs.

``normalize_advantages`` whitens ``A`` over all the batch's response tokens (computed in the
preparation pass, so it does not depend on minibatches or micro-batches).

``value_pretrain_steps``: the run's first trainer steps train the critic alone (the policy's
learning rate is 0; the policy-gradient term is still computed, and Adam's moments for the
policy see it). Useful with a fresh critic on a pretrained policy, whose early advantages are
otherwise noise.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from marin_rl_core import (
    LossPlan,
    LossPlugin,
    PolicyGradientConfig,
    PolicyGradientLoss,
    hookimpl,
    one_of,
)


@attrs.frozen(kw_only=True)
class PPOConfig(PolicyGradientConfig):
    """Args (and those of :class:`~marin_rl_core.learner.policy_gradient.PolicyGradientConfig`):
    gamma, lam: GAE's discount and its bias-variance trade-off.
    critic: ``"head"`` or ``"model"`` (module docstring).
    critic_learning_rate: the critic's peak learning rate; 0 uses ``trainer.learning_rate``.
    vf_coef: weight of the value loss.
    vf_clip: the value is clipped to within this of the critic's value before the step's
        updates (binds with several updates per batch).
    normalize_advantages: whiten GAE's advantages over the batch's response tokens.
    epochs: passes over each sampled batch.
    minibatches: parts each pass cuts the batch into, one optimizer update each (a divisor of
        ``trainer.batch_size``).
    value_pretrain_steps: the run's first trainer steps train the critic only.
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
    epochs: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    minibatches: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    value_pretrain_steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    kl_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))


class PPOLoss(PolicyGradientLoss):
    """Implements :class:`marin_rl_core.RLLossModule`; see the module docstring."""

    @property
    def plan(self) -> LossPlan:
        """Per-token rewards; the critic as trainable state at its own learning rate; epochs of
        minibatches after ``value_pretrain_steps``; ``V_old``, GAE and whitening prepared once
        per step when the step makes several updates or whitens (module docstring)."""
        c = self.config
        prepare = c.epochs * c.minibatches > 1 or c.normalize_advantages
        return LossPlan(
            aggregation=(c.aggregation, c.aggregation_length),
            token_rewards=True,
            epochs=c.epochs,
            minibatches=c.minibatches,
            frozen_policy_steps=c.value_pretrain_steps,
            init_state=self.init_critic,
            state_learning_rate=c.critic_learning_rate or None,
            create_prepare_fn=self.create_prepare if prepare else None,
        )

    def _values(self, model: Any, batch: Any, *, key: Any = None) -> tuple[Any, ...]:
        """The critic's values ``[batch, position]`` (and, for a value head, the policy's
        log-probabilities and entropies from the same forward pass; else ``None``)."""
        from marin_rl_core import (
            batch_hidden_states,
            batch_logprobs_and_entropy,
        )

        policy, critic = model.policy, model.loss_state
        if critic.trunk is None:
            logp, ent, hidden = batch_logprobs_and_entropy(policy, batch, key=key, with_hidden=True)
            return critic.head(hidden), logp, ent
        return critic.head(batch_hidden_states(critic.trunk, batch)), None, None

    def _advantages(self, batch: Any, values: Any) -> tuple[Any, Any]:
        from marin_rl_plugins.ppo_critic import gae

        segments = None if batch.segment_ids is None else batch.segment_ids.array
        return gae(
            batch.token_rewards.array,
            values,
            batch.loss_mask.array,
            segments,
            gamma=self.config.gamma,
            lam=self.config.lam,
        )

    def create_prepare(self, reference_model: Any, train_model: Any) -> Any:
        """The plan's ``create_prepare_fn``: ``V_old``, GAE's ``A`` and ``R`` and the whitening
        on all of a step's minibatches, before its updates."""
        import jax

        from marin_rl_core import as_named, batch_hidden_states, whiten

        c = self.config

        def prepare(model: Any, batches: Any) -> Any:
            found = []
            for batch in batches:
                critic = model.loss_state
                trunk = model.policy if critic.trunk is None else critic.trunk
                values = jax.lax.stop_gradient(critic.head(batch_hidden_states(trunk, batch)))
                found.append((values, *self._advantages(batch, values)))
            if c.normalize_advantages:  # over every response token of the step
                masks = [b.loss_mask.array for b in batches]
                whitened = whiten([a for _, a, _ in found], masks)
                found = [(v, a, r) for (v, _, r), a in zip(found, whitened)]
            return tuple(
                {
                    "values": as_named(v, b.loss_mask),
                    "advantages": as_named(a, b.loss_mask),
                    "returns": as_named(r, b.loss_mask),
                }
                for (v, a, r), b in zip(found, batches)
            )

        return prepare

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rewards - rewards.mean()  # the replay buffer's preference only (docstring)

    def init_critic(self, policy: Any, *, key: Any) -> Any:
        """The plan's ``init_state``: a value head on the policy's hidden states, or on a copy of
        the policy's own (``critic = "model"``)."""
        import equinox as eqx
        import jax
        from marin_rl_plugins.ppo_critic import Critic, ValueHead

        trunk = None
        if self.config.critic == "model":
            trunk = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, policy)
        return Critic(trunk=trunk, head=ValueHead.init(policy.Embed))

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Any:
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        from marin_rl_core import (
            TokenLoss,
            as_named,
            batch_logprobs_and_entropy,
            policy_gradient_loss,
            whiten,
        )

        c = self.config
        if c.kl_coef > 0 and reference_model is None:
            raise ValueError("ppo with kl_coef > 0 needs the reference model; got None")
        sg = jax.lax.stop_gradient

        def loss_fn(model: Any, batch: Any, *, key: Any = None) -> Any:
            values, logp, ent = self._values(model, batch, key=key)
            if logp is None:
                logp, ent = batch_logprobs_and_entropy(model.policy, batch, key=key)
            if batch.prepared is not None:  # computed once before the step's updates
                old = batch.prepared["values"].array
                advantages = batch.prepared["advantages"].array
                returns = batch.prepared["returns"].array
            else:  # one update per batch: the values before it are these
                old = sg(values)
                advantages, returns = self._advantages(batch, old)
                if c.normalize_advantages:  # a batch not prepared (a loss called directly)
                    advantages = whiten(advantages, batch.loss_mask.array)
            pg_batch = eqx.tree_at(
                lambda b: b.advantages, batch, as_named(advantages, batch.advantages)
            )
            ref = None
            if c.kl_coef > 0:
                ref = sg(batch_logprobs_and_entropy(reference_model, batch)[0])
            out = policy_gradient_loss(c, pg_batch, logp, ent, ref)
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
