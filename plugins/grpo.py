"""The ``grpo`` loss: group-relative advantages with the policy-gradient objective's options.

Advantages (per group of ``n`` samples of one problem, rewards ``r_1..r_n``, after over-long
shaping)::

    advantage_norm = "none":            A_i = r_i
                   = "group_mean":      A_i = r_i - mean(r)                       (Dr. GRPO)
                   = "group_mean_std":  A_i = (r_i - mean(r)) / (std(r) + 1e-6)   (GRPO)

Over-long shaping (DAPO), with ``L = overlong_length`` and ``B = overlong_buffer`` and a response
of ``n`` sampled tokens: the reward loses ``overlong_penalty * min(1, (n - (L - B)) / B)`` once
``n > L - B``. ``drop_zero_variance_groups`` drops groups whose rewards are all equal before
they reach a batch (DAPO's dynamic sampling: paced rollout workers generate that many again).

The loss is :mod:`marin_rl_core.learner.policy_gradient`'s (clip bounds, dual clip, GSPO's
sequence ratio, CISPO, truncated importance sampling, KL estimator and placement, entropy bonus,
aggregation). The defaults are GRPO's: sequence-mean aggregation, k3 KL in the loss.
"""

from __future__ import annotations

import attrs
import numpy as np

from marin_rl_core import (
    LOSS_AGGREGATIONS,
    LossPlugin,
    PolicyGradientConfig,
    PolicyGradientLoss,
    hookimpl,
    one_of,
)

ADVANTAGE_NORMS = ("none", "group_mean", "group_mean_std")


@attrs.frozen(kw_only=True)
class GRPOConfig(PolicyGradientConfig):
    """Args (and those of :class:`~marin_rl_core.learner.policy_gradient.PolicyGradientConfig`):
    advantage_norm: ``"none"``, ``"group_mean"`` or ``"group_mean_std"`` (module docstring).
    """

    advantage_norm: str = attrs.field(default="group_mean_std", validator=one_of(*ADVANTAGE_NORMS))
    kl_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))
    aggregation: str = attrs.field(default="sequence_mean", validator=one_of(*LOSS_AGGREGATIONS))


def grpo_advantages(rewards: np.ndarray, norm: str) -> np.ndarray:
    """Group-relative advantages of one group's rewards (see the module docstring)."""
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if norm == "none":
        return rewards.astype(np.float32)
    advantages = rewards - rewards.mean()
    if norm == "group_mean_std":
        advantages = advantages / (rewards.std() + 1e-6)
    return advantages.astype(np.float32)


class GRPOLoss(PolicyGradientLoss):
    """Implements :class:`marin_rl_core.RLLossModule`; see the module docstring."""

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return grpo_advantages(rewards, self.config.advantage_norm)


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(
        name="grpo",
        summary="GRPO: group-normalised advantages; clip-higher, GSPO, CISPO, TIS, KL options.",
        config_class=GRPOConfig,
        build=GRPOLoss,
    )
