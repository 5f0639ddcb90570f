"""The ``rloo`` loss: REINFORCE leave-one-out advantages with a PPO-style clipped importance ratio.

Advantages (per group of ``n`` samples of one problem, rewards ``r_1..r_n``)::

    A_i = r_i - mean_{j != i} r_j            (n >= 2; a group of one gets A = 0)
        = n / (n - 1) * (r_i - mean(r))

optionally divided by ``std(r) + 1e-6`` (``normalize_std``; a group whose rewards are all equal
stays at 0).

Loss, over the response tokens of a :class:`~marin_rl_core.learner.training_batch.TrainingBatch`
(:mod:`marin_rl_core.learner.policy_gradient` with its defaults)::

    ratio_t = exp(logp_t - behaviour_logp_t)
    l_t     = -min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t)  +  kl_coef * kl_t
    loss    = sum_t l_t / N_tokens                 (over every response token of the step)

Normalisation: a *token-level* mean over every response token of the step (the DAPO choice),
done once by the framework over all micro-batches: each token weighs the same, so long responses
count more than short ones, and a step's loss does not depend on how its tokens are split into
rows or micro-batches. ``kl_t`` is the non-negative "k3" estimator of KL(policy || reference),
``exp(ref_t - logp_t) - (ref_t - logp_t) - 1``. Every option of the policy-gradient objective
(clip bounds, dual clip, GSPO, CISPO, truncated importance sampling, KL estimator and placement,
entropy bonus, aggregation, over-long shaping, dropping uninformative groups) applies.
"""

from __future__ import annotations

import attrs
import numpy as np

from marin_rl_core import LossPlugin, PolicyGradientConfig, PolicyGradientLoss, hookimpl


@attrs.frozen(kw_only=True)
class RLOOConfig(PolicyGradientConfig):
    """Args (and those of :class:`~marin_rl_core.learner.policy_gradient.PolicyGradientConfig`):
    kl_coef: weight of the KL penalty to the frozen initial policy (it keeps the policy from
        going deterministic; docs/default-task.md); 0 keeps no reference model.
    clip_epsilon: above 0, sets both ``clip_low`` and ``clip_high`` (the one bound configs
        written before those two had); 0 leaves them as they are.
    normalize_std: divide each group's advantages by the std of its rewards.
    """

    kl_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))
    clip_epsilon: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    normalize_std: bool = False

    def policy_gradient(self) -> PolicyGradientConfig:
        """The policy-gradient options, ``clip_epsilon`` applied."""
        fields = {f.name: getattr(self, f.name) for f in attrs.fields(PolicyGradientConfig)}
        if self.clip_epsilon > 0:
            fields["clip_low"] = fields["clip_high"] = self.clip_epsilon
        return PolicyGradientConfig(**fields)


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


class RLOOLoss(PolicyGradientLoss):
    """Implements :class:`marin_rl_core.RLLossModule`; see the module docstring."""

    def __init__(self, config: RLOOConfig):
        super().__init__(config)
        self.objective = config.policy_gradient()

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rloo_advantages(rewards, normalize_std=self.config.normalize_std)


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(
        name="rloo",
        summary="RLOO: leave-one-out advantages, clipped importance ratio, optional KL penalty.",
        config_class=RLOOConfig,
        build=RLOOLoss,
    )
