"""The policy-gradient objective every built-in policy loss shares (``rloo``, ``grpo``), with the
options users reach for; a third-party loss can build on it the same way.

Per response token ``t`` of rollout ``i``, with ``logp`` the policy's log-probability now,
``b`` the sampler's (the behaviour policy), ``A`` the advantage and ``sg`` stop-gradient::

    old      = b                           (tis_cap = 0)
             = sg(logp)                    (tis_cap > 0; then w_t = min(exp(sg(logp) - b), tis_cap))
    r_t      = exp(logp_t - old_t)         (ratio = "token")
             = exp(sg(mean_i(logp - old)) + logp_t - sg(logp_t))
                                           (ratio = "sequence", GSPO: every token of i carries the
                                            sequence's ratio; its gradient is that of logp_t)
    clip     : o_t = min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)
               dual_clip c > 1: o_t = max(o_t, c A) where A < 0
    cispo    : o_t = sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A logp_t
                   (the clipped ratio only weighs the gradient; every token keeps one)
    l_t      = -w_t o_t + kl_coef k_t - entropy_coef H_t         (kl_in = "loss")
    A_t      = A - kl_coef sg(sum_{t' >= t} k_t')                (kl_in = "reward", instead)

``k_t`` is the per-token KL estimate to the reference model
(:func:`~marin_rl_core.learner.loss.kl_penalty`), ``H_t`` the policy's entropy. The framework
weighs the ``l_t`` into the step's loss by ``aggregation``
(:mod:`~marin_rl_core.learner.loss`). Logged every step, as token means: ``ratio_mean``,
``clip_fraction``, ``entropy``, ``kl``, ``policy_loss``, and the trainer-sampler mismatch
``sampler_kl`` (k3 between the trainer's log-probabilities before the update and the sampler's)
with ``sampler_ratio_mean`` / ``_max`` / ``_min``.
"""

from __future__ import annotations

from typing import Any

import attrs

from marin_rl_core.errors import one_of
from marin_rl_core.protocols import LOSS_AGGREGATIONS, LossPlan

KL_ESTIMATORS = ("k1", "k2", "k3")
"""The per-token KL estimators (:func:`marin_rl_core.learner.loss.kl_penalty`)."""


@attrs.frozen(kw_only=True)
class PolicyGradientConfig:
    """The objective's options (module docstring for the formulas).

    Args:
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``;
            ``clip_high`` above ``clip_low`` is DAPO's "clip higher".
        dual_clip: ``c > 1`` bounds the objective of a negative advantage at ``c * A`` (dual
            clip); 0 is off.
        ratio: ``"token"`` (PPO) or ``"sequence"`` (GSPO: the geometric mean over the rollout;
            use small clip bounds, such as 3e-4 and 4e-4, and ``aggregation = "sequence_mean"``).
        objective: ``"clip"`` (PPO's clipped surrogate) or ``"cispo"`` (a clipped,
            stop-gradient importance weight on ``A * logp``).
        tis_cap: 0 compares the policy with the sampler's log-probabilities directly. Above 0,
            truncated importance sampling: the ratio is taken against the trainer's own
            log-probabilities at the step, and each token is weighted by the trainer-sampler
            ratio truncated at ``tis_cap`` (2.0 is common).
        kl_coef: weight of the KL to the frozen initial policy; 0 keeps no reference model.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        kl_in: ``"loss"`` (a penalty term) or ``"reward"`` (subtracted from each token's
            advantage as the KL still to come in its rollout).
        entropy_coef: weight of the entropy bonus (its gradient trains the policy).
        aggregation: ``"token_mean"``, ``"sequence_mean"`` or ``"sum_over_length"``
            (:mod:`~marin_rl_core.learner.loss`).
        aggregation_length: ``L`` of ``"sum_over_length"``; 0 uses ``model.max_seq_len``.
        overlong_length, overlong_buffer, overlong_penalty: over-long shaping (DAPO): a
            response of ``n`` sampled tokens loses ``overlong_penalty * min(1, (n - (L - B)) /
            B)`` of its reward once ``n > L - B`` (``L = overlong_length``, usually the
            sampling ``max_tokens``; ``B = overlong_buffer``); ``overlong_length = 0`` is off.
        drop_zero_variance_groups: groups whose rewards are all equal carry no policy gradient
            (their advantages are 0) but dilute the batch; drop them before they reach one
            (DAPO's dynamic sampling). Paced rollout workers generate that many again; while
            every group is uninformative (a task the policy cannot yet solve at all) the
            trainer waits.
    """

    clip_low: float = attrs.field(default=0.2, validator=attrs.validators.gt(0.0))
    clip_high: float = attrs.field(default=0.2, validator=attrs.validators.gt(0.0))
    dual_clip: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    ratio: str = attrs.field(default="token", validator=one_of("token", "sequence"))
    objective: str = attrs.field(default="clip", validator=one_of("clip", "cispo"))
    tis_cap: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    kl_coef: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    kl_estimator: str = attrs.field(default="k3", validator=one_of(*KL_ESTIMATORS))
    kl_in: str = attrs.field(default="loss", validator=one_of("loss", "reward"))
    entropy_coef: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    aggregation: str = attrs.field(default="token_mean", validator=one_of(*LOSS_AGGREGATIONS))
    aggregation_length: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    overlong_length: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    overlong_buffer: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    overlong_penalty: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    drop_zero_variance_groups: bool = False

    def __attrs_post_init__(self) -> None:
        if 0 < self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be 0 (off) or above 1, got {self.dual_clip}")
        if 0 < self.tis_cap < 1.0:
            raise ValueError(f"tis_cap must be 0 (off) or at least 1, got {self.tis_cap}")
        if self.overlong_length and not 0 < self.overlong_buffer < self.overlong_length:
            raise ValueError(
                f"overlong_buffer must be above 0 and below overlong_length "
                f"({self.overlong_length}), got {self.overlong_buffer}"
            )


def group_rewards(config: PolicyGradientConfig, group: Any) -> Any:
    """The rewards of a group's rollouts after over-long shaping (float64 numpy), or ``None``
    when ``drop_zero_variance_groups`` drops the group."""
    import numpy as np

    rewards = np.asarray(group.rewards, dtype=np.float64).reshape(-1)
    if config.drop_zero_variance_groups and rewards.size and np.all(rewards == rewards[0]):
        return None
    if config.overlong_length:
        start = config.overlong_length - config.overlong_buffer
        lengths = np.asarray([r.num_policy_tokens for r in group.rollouts], dtype=np.float64)
        over = np.clip((lengths - start) / config.overlong_buffer, 0.0, 1.0)
        rewards = rewards - config.overlong_penalty * over
    return rewards


class PolicyGradientLoss:
    """An :class:`~marin_rl_core.RLLossModule` on this objective (``rloo`` and ``grpo`` are
    two): a subclass gives :meth:`group_advantages`; over-long shaping, dropping uninformative
    groups, the reference model (when ``kl_coef > 0``) and the aggregation come from
    ``config``."""

    def __init__(self, config: PolicyGradientConfig):
        self.config = config
        self.objective = config

    def group_advantages(self, rewards: Any) -> Any:
        """One advantage per reward of a group (float64 numpy, already shaped)."""
        raise NotImplementedError

    @property
    def needs_reference_model(self) -> bool:
        return self.objective.kl_coef > 0

    @property
    def plan(self) -> LossPlan:
        """The :class:`~marin_rl_core.protocols.LossPlan`: the config's aggregation, one update
        per step."""
        return LossPlan(aggregation=(self.objective.aggregation, self.objective.aggregation_length))

    def build(self, reference_model: Any) -> PolicyGradientLoss:
        return self

    def compute_advantages(self, group: Any) -> Any:
        import numpy as np

        rewards = group_rewards(self.config, group)
        if rewards is None:  # dropped: no reward variance
            return np.full(len(group.rollouts), np.nan, dtype=np.float32)
        return np.asarray(self.group_advantages(rewards), dtype=np.float32)

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Any:
        return policy_gradient_loss_fn(self.objective, reference_model)


def policy_gradient_loss_fn(config: PolicyGradientConfig, reference_model: Any) -> Any:
    """``loss_fn(model, batch, *, key)`` of :func:`policy_gradient_loss` with the policy's
    log-probabilities and entropy (and the reference's, when ``kl_coef > 0``): what a loss
    module's ``create_loss_fn`` returns."""
    import jax

    from marin_rl_core.learner.training_batch import batch_logprobs_and_entropy

    if config.kl_coef > 0 and reference_model is None:
        raise ValueError("a loss with kl_coef > 0 needs the reference model; got None")

    def loss_fn(model: Any, batch: Any, *, key: Any = None) -> Any:
        # Packed rows (several rollouts per row) are kept apart by the batch's segment ids.
        logprobs, entropy = batch_logprobs_and_entropy(model, batch, key=key)
        ref = None
        if config.kl_coef > 0:
            ref = jax.lax.stop_gradient(batch_logprobs_and_entropy(reference_model, batch)[0])
        return policy_gradient_loss(config, batch, logprobs, entropy, ref)

    return loss_fn


def policy_gradient_loss(
    config: PolicyGradientConfig,
    batch: Any,
    logprobs: Any,
    entropy: Any,
    ref_logprobs: Any = None,
) -> Any:
    """The :class:`~marin_rl_core.learner.loss.TokenLoss` of the objective on ``batch`` (a
    :class:`~marin_rl_core.learner.training_batch.TrainingBatch`), given the policy's
    ``logprobs`` and ``entropy`` and, when ``kl_coef > 0``, the reference's ``ref_logprobs``
    (all ``[batch, position]`` NamedArrays or arrays)."""
    import jax
    import jax.numpy as jnp

    from marin_rl_core.learner.loss import (
        TokenLoss,
        as_named,
        kl_penalty,
        masked_max,
        masked_min,
        reward_to_go,
        sequence_mean,
    )

    sg = jax.lax.stop_gradient
    c = config
    logp = getattr(logprobs, "array", logprobs)
    ent = getattr(entropy, "array", entropy)
    mask = batch.loss_mask.array
    behaviour = batch.behaviour_logprobs.array
    advantages = batch.advantages.array
    segments = None if batch.segment_ids is None else batch.segment_ids.array

    metrics: dict[str, Any] = {"entropy": ent}
    kl = None
    if c.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference model's log-probabilities")
        kl = kl_penalty(logp, sg(getattr(ref_logprobs, "array", ref_logprobs)), c.kl_estimator)
        metrics["kl"] = kl
        if c.kl_in == "reward":
            advantages = advantages - c.kl_coef * sg(reward_to_go(kl, mask, segments))

    # Trainer against sampler, before this step's update: staleness and numerical mismatch.
    sampler_log_ratio = sg(logp) - behaviour
    sampler_ratio = jnp.exp(sampler_log_ratio)
    metrics["sampler_ratio_mean"] = sampler_ratio
    metrics["sampler_kl"] = jnp.exp(-sampler_log_ratio) + sampler_log_ratio - 1.0
    if c.tis_cap > 0:
        old = sg(logp)
        weight = jnp.minimum(sampler_ratio, c.tis_cap)
    else:
        old = behaviour
        weight = 1.0
    log_ratio = logp - old
    if c.ratio == "sequence":
        log_ratio = sg(sequence_mean(log_ratio, mask, segments)) + logp - sg(logp)
    ratio = jnp.exp(log_ratio)
    bounded = jnp.clip(ratio, 1.0 - c.clip_low, 1.0 + c.clip_high)
    if c.objective == "clip":
        unclipped = ratio * advantages
        clipped = bounded * advantages
        objective = jnp.minimum(unclipped, clipped)
        was_clipped = clipped < unclipped
        if c.dual_clip > 0:
            floor = c.dual_clip * advantages
            was_clipped = was_clipped | ((advantages < 0) & (objective < floor))
            objective = jnp.where(advantages < 0, jnp.maximum(objective, floor), objective)
    else:  # cispo
        objective = sg(bounded) * advantages * logp
        was_clipped = bounded != ratio
    policy_loss = -weight * objective
    loss = policy_loss
    if kl is not None and c.kl_in == "loss":
        loss = loss + c.kl_coef * kl
    if c.entropy_coef > 0:
        loss = loss - c.entropy_coef * ent
    metrics["policy_loss"] = policy_loss
    metrics["ratio_mean"] = ratio
    metrics["clip_fraction"] = was_clipped.astype(jnp.float32)
    metrics["behaviour_neg_logprob"] = -behaviour
    like = batch.loss_mask
    return TokenLoss(
        loss=as_named(loss, like),
        metrics={
            name: as_named(jnp.broadcast_to(v, mask.shape), like) for name, v in metrics.items()
        },
        scalars={
            "num_tokens": jnp.sum(mask),
            "sampler_ratio_max": masked_max(sampler_ratio, mask),
            "sampler_ratio_min": masked_min(sampler_ratio, mask),
        },
    )


__all__ = [
    "PolicyGradientConfig",
    "PolicyGradientLoss",
    "group_rewards",
    "policy_gradient_loss",
    "policy_gradient_loss_fn",
]
