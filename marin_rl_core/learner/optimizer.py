"""The trainer's optimizer: AdamW after global-norm clipping, on a warmup-then-decay learning-rate
schedule that counts optimizer updates (:func:`make_schedule`), with AdamW of its own for a loss's
trainable state (a critic) when there is one (:func:`make_optimizer`)."""

from __future__ import annotations

from typing import Any

from marin_rl_core.config.schema import TrainerConfig


def make_schedule(t: TrainerConfig, *, updates_per_step: int = 1, frozen_updates: int = 0) -> Any:
    """The learning rate against the optimizer update: linear warmup to ``learning_rate``, then
    ``lr_schedule`` down to ``min_lr_ratio * learning_rate`` at the run's last update.

    A loss that makes ``updates_per_step`` updates per trainer step (PPO's epochs x
    minibatches) stretches the warmup and the decay over as many updates. The first
    ``frozen_updates`` updates get rate 0 (the policy during value pretraining); the warmup and
    decay start after them and still end at the run's last update."""
    import optax

    updates_per_step = max(updates_per_step, 1)
    total = max(t.num_train_steps * updates_per_step - frozen_updates, 1)
    peak, warmup = t.learning_rate, max(t.warmup_steps, 0) * updates_per_step
    end = peak * (1.0 if t.lr_schedule == "constant" else t.min_lr_ratio)
    decay_steps = max(total - warmup, 1)
    if t.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=t.min_lr_ratio)
    else:  # linear, or constant (end == peak)
        decay = optax.linear_schedule(peak, end, decay_steps)
    schedule = decay
    if warmup > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(peak / warmup, peak, warmup), decay], boundaries=[warmup]
        )
    if frozen_updates > 0:
        schedule = optax.join_schedules(
            [optax.constant_schedule(0.0), schedule], boundaries=[frozen_updates]
        )
    return schedule


def make_optimizer(
    t: TrainerConfig,
    *,
    state_learning_rate: float | None = None,
    updates_per_step: int = 1,
    frozen_policy_updates: int = 0,
) -> Any:
    """AdamW on :func:`make_schedule`, after global-norm clipping (if ``max_grad_norm > 0``).

    With ``state_learning_rate`` (a loss with trainable state: the model trained is a
    :class:`~marin_rl_core.learner.loss.TrainedModel`), the loss's state gets AdamW of its own
    at that peak learning rate, on the same schedule shape, and is never frozen.
    ``updates_per_step`` and ``frozen_policy_updates``: the loss's
    :class:`~marin_rl_core.protocols.UpdatePlan` (:func:`make_schedule`)."""
    import attrs
    import optax

    def adamw(config: TrainerConfig, frozen: int) -> Any:
        schedule = make_schedule(config, updates_per_step=updates_per_step, frozen_updates=frozen)
        return optax.adamw(schedule, b1=0.9, b2=0.99, eps=t.adam_eps, weight_decay=t.weight_decay)

    parts = []
    if t.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(t.max_grad_norm))
    if state_learning_rate is None:
        parts.append(adamw(t, frozen_policy_updates))
    else:
        parts.append(
            optax.multi_transform(
                {
                    "policy": adamw(t, frozen_policy_updates),
                    "loss_state": adamw(attrs.evolve(t, learning_rate=state_learning_rate), 0),
                },
                _param_labels,
            )
        )
    return optax.chain(*parts)


def _param_labels(params: Any) -> Any:
    import jax

    from marin_rl_core.learner.loss import TrainedModel

    if not isinstance(params, TrainedModel):
        return jax.tree.map(lambda _: "policy", params)
    return TrainedModel(
        policy=jax.tree.map(lambda _: "policy", params.policy),
        loss_state=jax.tree.map(lambda _: "loss_state", params.loss_state),
    )
