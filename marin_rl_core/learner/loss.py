"""The loss contract on the trainer's side, and the pieces policy-gradient losses are made of.

A loss plugin's ``loss_fn(model, batch, *, key)`` returns a :class:`TokenLoss`: a loss value per
token and per-token metrics, nothing normalised. The framework weighs them once, over the whole
step, by the loss's declared aggregation (``RLLossModule.aggregation``):

* ``token_mean``: every response token of the step weighs the same,
  ``loss = sum_t l_t / N_tokens``;
* ``sequence_mean``: each rollout's tokens are averaged, then the rollouts,
  ``loss = (1 / N_seq) sum_i (1 / n_i) sum_{t in i} l_t``;
* ``sum_over_length``: summed over each rollout's tokens and divided by one fixed length ``L``
  for all (Dr. GRPO), ``loss = (1 / N_seq) sum_i (1 / L) sum_{t in i} l_t``.

The weights (``TrainingBatch.loss_weight``) are computed when the batch is built, from all of
its rows, and the step is one program over the whole batch, so the loss and its gradients do not
depend on how the batch is cut into micro-batches, packed into rows, or split over data-parallel
devices (``tests/test_losses.py`` cuts one batch four ways). Per-token metrics are reported as
token means over the step (``TrainingBatch.token_weight``).

A loss function returning ``(scalar_loss, metrics)`` (the contract before issue 26) is refused
with the way to migrate (:func:`checked_token_loss`; docs/losses.md).

Everything else here works on plain ``jax.numpy`` arrays ``[batch, position]`` aligned as
:mod:`~marin_rl_core.learner.training_batch` lays them out; ``tests/test_losses.py`` checks each
against a plain numpy reference.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from marin_rl_core.protocols import LOSS_AGGREGATIONS as AGGREGATIONS
from marin_rl_core.protocols import LossPlan, loss_plan  # noqa: F401 - re-exported


class TokenLoss(eqx.Module):
    """What a loss function returns.

    Args:
        loss: ``[batch, position]`` NamedArray, the loss of each position; positions outside
            the loss mask are ignored (they may hold anything finite or not).
        metrics: per-token ``[batch, position]`` NamedArrays, each reported as its mean over the
            step's response tokens (``train/<name>``).
        scalars: scalar metrics computed by the loss itself, reduced over micro-batches by
            name as levanter does (``num_*``/``*_sum`` summed, ``*_max``/``*_min``, else the
            mean of the micro-batches' values).
    """

    loss: NamedArray
    metrics: dict[str, NamedArray] = eqx.field(default_factory=dict)
    scalars: dict[str, Any] = eqx.field(default_factory=dict)


class TrainedModel(eqx.Module):
    """What the trainer trains when the loss has trainable state of its own
    (``RLLossModule.init_state``: a critic): the policy and that state, optimised, sharded and
    checkpointed together. Only ``policy`` is published to rollout workers, evaluated and
    exported; the loss function receives the whole."""

    policy: Any
    loss_state: Any


def with_loss_state(
    plan: LossPlan, policy: Any, *, key: jax.Array, learning_rate: float
) -> tuple[Any, float | None]:
    """What the trainer trains for a loss with ``plan``: ``(policy, None)``, or, when the plan's
    ``init_state`` gives trainable state, ``(TrainedModel(policy, state), the state's learning
    rate)`` (the plan's ``state_learning_rate``, else ``learning_rate``)."""
    state = plan.init_state(policy, key=key) if plan.init_state is not None else None
    if state is None:
        return policy, None
    return TrainedModel(policy=policy, loss_state=state), float(
        plan.state_learning_rate or learning_rate
    )


def batch_options(plan: LossPlan) -> dict[str, Any]:
    """The arguments of
    :func:`~marin_rl_core.learner.training_batch.training_batch_from_rollouts` that a loss's
    ``plan`` decides (its ``aggregation`` and ``token_rewards``)."""
    return {"aggregation": plan.aggregation, "token_rewards": plan.token_rewards}


def checked_token_loss(out: Any) -> TokenLoss:
    """``out``, what a loss plugin's ``loss_fn`` returned, when it is a :class:`TokenLoss`;
    else a ``TypeError`` saying how to migrate (raised while the step is traced)."""
    if isinstance(out, TokenLoss):
        return out
    raise TypeError(
        f"a loss function returned a {type(out).__name__}, not a marin_rl_core.TokenLoss. "
        "Since issue 26 a loss returns per-token values, which the framework weighs over the "
        "whole step: return TokenLoss(loss=<the [batch, position] values you summed or "
        "averaged>, metrics={...per-token...}) and, if you averaged per sequence, declare "
        'plan = LossPlan(aggregation="sequence_mean"); see docs/losses.md, "Migrating a loss"'
    )


def policy_of(model: Any) -> Any:
    """The policy of what the trainer trains (``model`` itself without loss state)."""
    return model.policy if isinstance(model, TrainedModel) else model


def aggregate(out: TokenLoss, batch: Any) -> tuple[jax.Array, dict[str, Any]]:
    """``(loss, metrics)`` of a :class:`TokenLoss` on ``batch`` (a micro-batch of the step):
    weighted sums with the batch's step-wide weights. The metrics are levanter ``Metric``s."""
    from levanter.metrics import Metric, ReductionType

    weight = batch.loss_weight.array
    loss = jnp.sum(jnp.where(weight != 0, out.loss.array, 0.0) * weight)
    token_weight = batch.token_weight.array
    metrics: dict[str, Any] = {
        # A micro-batch's share of the step; levanter averages these over the micro-batches
        # and the weights are scaled by their number (Learner), so the mean is the step's.
        name: Metric.from_value(
            jnp.sum(jnp.where(token_weight != 0, value.array, 0.0) * token_weight),
            ReductionType.MEAN,
        )
        for name, value in out.metrics.items()
    }
    metrics.update(out.scalars)
    return loss, metrics


def step_loss(
    loss_fn: Any, model: Any, batch: Any, *, key: Any = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss_fn``'s loss and metrics on ``batch`` taken as one whole step (no micro-batches),
    as the trainer weighs them: for tests, benchmarks and notebooks."""
    from levanter.metrics import Metric

    loss, metrics = aggregate(checked_token_loss(loss_fn(model, batch, key=key)), batch)
    return loss, {k: v.value() if isinstance(v, Metric) else v for k, v in metrics.items()}


def token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of ``values`` over the positions where ``mask`` is 1 (0 when there are none):
    for metrics a loss computes within one micro-batch."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def whiten(values: Any, mask: Any) -> Any:
    """``values`` shifted and scaled to mean 0 and standard deviation 1 over the positions
    where ``mask`` is 1 (0 elsewhere). Lists of arrays (a step's minibatches) are whitened
    together, by the statistics of all of them."""
    if not isinstance(values, (list, tuple)):
        return whiten([values], [mask])[0]
    count = jnp.maximum(sum(jnp.sum(m) for m in mask), 1.0)
    mean = sum(jnp.sum(v * m) for v, m in zip(values, mask)) / count
    var = sum(jnp.sum(jnp.square(v - mean) * m) for v, m in zip(values, mask)) / count
    scale = 1.0 / (jnp.sqrt(var) + 1e-8)
    return [jnp.where(m > 0, (v - mean) * scale, 0.0) for v, m in zip(values, mask)]


def masked_max(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(mask > 0, values, -jnp.inf), initial=-jnp.inf)


def masked_min(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.min(jnp.where(mask > 0, values, jnp.inf), initial=jnp.inf)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL(policy || reference) by ``estimator``, from ``d = logp - ref_logp``:
    ``k1 = d`` (unbiased, can be negative), ``k2 = d**2 / 2``, ``k3 = exp(-d) + d - 1``
    (unbiased and never negative)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    if estimator == "k3":
        return jnp.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def sequence_mean(values: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Each position's rollout's mean of ``values`` over its masked positions, broadcast back
    to ``[batch, position]``. Unpacked rows are one rollout each; packed rows are split by
    ``segment_ids`` (``-1`` padding). Rows stay where they are (no gather across the batch)."""
    masked = jnp.where(mask > 0, values, 0.0)
    if segment_ids is None:
        mean = jnp.sum(masked, axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(mask, axis=-1, keepdims=True), 1.0
        )
        return jnp.broadcast_to(mean, values.shape)
    width = values.shape[-1]
    ids = jnp.where(segment_ids >= 0, segment_ids, width)  # padding: one spare segment

    def per_row(v: jax.Array, m: jax.Array, i: jax.Array) -> jax.Array:
        sums = jax.ops.segment_sum(v, i, num_segments=width + 1)
        counts = jax.ops.segment_sum(m, i, num_segments=width + 1)
        return (sums / jnp.maximum(counts, 1.0))[i]

    return jax.vmap(per_row)(masked, mask, ids)


def reward_to_go(values: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """``sum_{t' >= t} values[t']`` over the masked positions of each position's own rollout
    (a per-token penalty turned into what it costs from each action on)."""
    masked = jnp.where(mask > 0, values, 0.0)
    # A reversed cumulative sum along each row ...
    suffix = jnp.flip(jnp.cumsum(jnp.flip(masked, -1), axis=-1), -1)
    if segment_ids is None:
        return suffix
    # ... minus what later rollouts of a packed row contributed: the suffix at the first
    # position after this rollout ends.
    width = values.shape[-1]
    pos = jnp.arange(width)
    ids = jnp.where(segment_ids >= 0, segment_ids, width)

    def per_row(s: jax.Array, i: jax.Array) -> jax.Array:
        last = jax.ops.segment_max(pos, i, num_segments=width + 1)  # last position of each
        after = jnp.minimum(last[i] + 1, width)
        padded = jnp.concatenate([s, jnp.zeros((1,), s.dtype)])
        return s - padded[after]

    return jax.vmap(per_row)(suffix, ids)


def as_named(values: jax.Array, like: NamedArray) -> NamedArray:
    """``values`` with the axes of ``like`` (a field of the batch)."""
    return hax.named(values, like.axes)


def non_finite_advice(
    head: str,
    bad: list[str],
    out: dict[str, float],
    *,
    params_finite: bool,
    kept: str,
    loss: str,
    precision: str,
) -> str:
    """What to tell the user when a step's ``bad`` values (``"loss"``, ``"grad_norm"``) are not
    finite: advice that fits what happened. Parameters blown up by the previous update: the
    learning rate. A non-finite loss from finite parameters: the loss plugin's own computation.
    A finite loss with a non-finite gradient: its derivative, or the compute precision."""
    if not params_finite:
        return (
            f"{head}: the previous update left the parameters non-finite, so the "
            f"{', '.join(bad)} followed. {kept}; lower trainer.learning_rate or "
            "trainer.max_grad_norm."
        )
    if "loss" in bad:
        return (
            f"{head}: the {loss!r} loss plugin's loss is {out['loss']} although the parameters "
            "are finite (before this step's update): the loss's own computation made it (a log "
            "or a division at zero, an overflow, a NaN advantage or reward reaching it); the "
            f"learning rate is not the cause. {kept}; fix the loss (--loss {loss}), then resume."
        )
    return (
        f"{head}: the gradient of the {loss!r} loss plugin's loss ({out['loss']:.4g}) is "
        f"{out['grad_norm']} with finite parameters: a function with an infinite derivative "
        "where it is evaluated (sqrt or log at 0), or an overflow in the compute precision "
        f'({precision}). {kept}; fix the loss, or train with trainer.precision = "f32".'
    )


__all__ = [
    "AGGREGATIONS",
    "TokenLoss",
    "TrainedModel",
    "aggregate",
    "as_named",
    "batch_options",
    "checked_token_loss",
    "kl_penalty",
    "LossPlan",
    "loss_plan",
    "masked_max",
    "masked_min",
    "non_finite_advice",
    "policy_of",
    "reward_to_go",
    "sequence_mean",
    "step_loss",
    "token_mean",
    "with_loss_state",
]
