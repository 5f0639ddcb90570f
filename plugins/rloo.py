"""The ``rloo`` loss: REINFORCE leave-one-out advantages with a PPO-style clipped importance ratio.

Advantages (per group of ``n`` samples of one problem, rewards ``r_1..r_n``)::

    A_i = r_i - mean_{j != i} r_j            (n >= 2; a group of one gets A = 0)
        = n / (n - 1) * (r_i - mean(r))

optionally divided by ``std(r) + 1e-6`` (``normalize_std``; a group whose rewards are all equal
stays at 0).

Loss, over the response tokens of a :class:`~marin_rl_core.learner.training_batch.TrainingBatch`::

    ratio_t = exp(logp_t - behaviour_logp_t)
    obj_t   = min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t)
    loss    = -sum_t(mask_t * obj_t) / sum_t(mask_t)  +  kl_coef * sum_t(mask_t * kl_t) / sum_t(mask_t)

Normalisation: a *token-level* mean over every response token of the batch (the DAPO choice):
each token weighs the same, so long responses count more than short ones, and a batch's loss
does not depend on how its tokens are split into rows. ``kl_t`` is the non-negative "k3"
estimator of KL(policy || reference), ``exp(ref_t - logp_t) - (ref_t - logp_t) - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from marin_rl_core import LossPlugin, RolloutGroup, hookimpl


@attrs.frozen(kw_only=True)
class RLOOConfig:
    """Args:
    kl_coef: weight of the KL penalty to the frozen initial policy (it keeps the policy from
        going deterministic; docs/default-task.md); 0 keeps no reference model.
    clip_epsilon: the importance ratio is clipped to ``[1 - clip_epsilon, 1 + clip_epsilon]``.
    normalize_std: divide each group's advantages by the std of its rewards.
    """

    kl_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))
    clip_epsilon: float = attrs.field(default=0.2, validator=attrs.validators.gt(0.0))
    normalize_std: bool = False


def rloo_advantages(rewards: np.ndarray, *, normalize_std: bool = False) -> np.ndarray:
    """Leave-one-out advantages of one group's rewards (see the module docstring)."""
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    n = rewards.shape[0]
    if n < 2:
        return np.zeros(n, dtype=np.float32)
    baseline = (rewards.sum() - rewards) / (n - 1)
    advantages = rewards - baseline
    if normalize_std:
        advantages = advantages / (rewards.std() + 1e-6)
    return advantages.astype(np.float32)


def clipped_objective_loss(
    logprobs: Any,
    behaviour_logprobs: Any,
    advantages: Any,
    loss_mask: Any,
    *,
    clip_epsilon: float,
) -> tuple[Any, dict[str, Any]]:
    """The clipped importance-weighted policy-gradient loss on plain ``jax.numpy`` arrays of one
    shape; returns ``(loss, {"ratio_mean", "clip_fraction"})`` (token-level means)."""
    import jax.numpy as jnp

    num_tokens = jnp.maximum(jnp.sum(loss_mask), 1.0)
    # Padding positions carry logprob 0 on both sides, so their ratio is exactly 1.
    ratio = jnp.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantages
    objective = jnp.minimum(unclipped, clipped)
    loss = -jnp.sum(objective * loss_mask) / num_tokens
    was_clipped = (clipped < unclipped).astype(jnp.float32)
    metrics = {
        "ratio_mean": jnp.sum(ratio * loss_mask) / num_tokens,
        "clip_fraction": jnp.sum(was_clipped * loss_mask) / num_tokens,
    }
    return loss, metrics


class RLOOLoss:
    """Implements :class:`marin_rl_core.RLLossModule`; see the module docstring."""

    def __init__(self, config: RLOOConfig):
        self.config = config

    @property
    def needs_reference_model(self) -> bool:
        return self.config.kl_coef > 0

    def build(self, reference_model: Any) -> RLOOLoss:
        return self

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        return rloo_advantages(group.rewards, normalize_std=self.config.normalize_std)

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        from marin_rl_core.learner.training_batch import batch_logprobs_and_entropy

        if self.needs_reference_model and reference_model is None:
            raise ValueError("rloo with kl_coef > 0 needs the reference model; got None")
        kl_coef = self.config.kl_coef
        clip_epsilon = self.config.clip_epsilon

        def loss_fn(model: Any, batch: Any, *, key: Any = None) -> tuple[Any, dict[str, Any]]:
            # Packed rows (several rollouts per row) are kept apart by the batch's segment ids.
            logprobs, entropy = batch_logprobs_and_entropy(model, batch, key=key)
            mask = batch.loss_mask.array
            num_tokens = jnp.maximum(jnp.sum(mask), 1.0)
            loss, metrics = clipped_objective_loss(
                logprobs.array,
                batch.behaviour_logprobs.array,
                batch.advantages.array,
                mask,
                clip_epsilon=clip_epsilon,
            )
            metrics["policy_loss"] = loss
            metrics["entropy"] = jnp.sum(entropy.array * mask) / num_tokens
            metrics["behaviour_neg_logprob"] = -jnp.sum(batch.behaviour_logprobs.array * mask) / num_tokens
            if kl_coef > 0:
                ref = batch_logprobs_and_entropy(reference_model, batch)[0].array
                ref = jax.lax.stop_gradient(ref)
                log_ratio = ref - logprobs.array
                kl = jnp.sum((jnp.exp(log_ratio) - log_ratio - 1.0) * mask) / num_tokens
                metrics["kl"] = kl
                loss = loss + kl_coef * kl
            metrics["loss"] = loss
            metrics["num_tokens"] = jnp.sum(mask)
            return loss, metrics

        return loss_fn


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(
        name="rloo",
        summary="RLOO: leave-one-out advantages, clipped importance ratio, optional KL penalty.",
        config_class=RLOOConfig,
        build=RLOOLoss,
    )
