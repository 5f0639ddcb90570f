"""What a loss asks of the trainer beyond :class:`~marin_rl_core.protocols.RLLossModule`'s
required members: one typed plan (:class:`LossPlan`), read in one place (:func:`loss_plan`), and
the aggregations a loss's per-token values are weighed by (:data:`LOSS_AGGREGATIONS`).

A leaf module, re-exported by :mod:`marin_rl_core.protocols` and ``marin_rl_core``: importing it
needs no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "sum_over_length")
"""How a loss's per-token values become the step's loss (:mod:`marin_rl_core.learner.loss`)."""


_OLD_LOSS_MEMBERS = (
    "aggregation",
    "needs_token_rewards",
    "init_state",
    "state_learning_rate",
    "update_epochs",
    "update_minibatches",
    "frozen_policy_steps",
    "create_prepare_fn",
)
"""Optional members of loss modules before :class:`LossPlan`; a module still declaring one is
refused with the way to migrate (:func:`loss_plan`)."""

_RENAMED = {
    "needs_token_rewards": "token_rewards",
    "update_epochs": "epochs",
    "update_minibatches": "minibatches",
}
"""Their names in :class:`LossPlan`, where they changed."""


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """Everything a loss asks of the trainer beyond :class:`RLLossModule`'s required members:
    the module's optional ``plan`` attribute (absent: ``LossPlan()``, a plain policy-gradient
    loss with one update per step). The trainer reads it once, when it builds the loss
    (:func:`loss_plan`); ``marinrl run`` reads it before the job starts, so a bad plan is a
    config error.

    Args:
        aggregation: how the per-token losses become the step's loss: one of
            :data:`LOSS_AGGREGATIONS`, or ``(name, length)`` (the ``L`` of
            ``"sum_over_length"``, 0 for ``model.max_seq_len``).
        token_rewards: fill ``TrainingBatch.token_rewards`` (per-token rewards, for value-based
            losses such as GAE).
        epochs, minibatches: each trainer step makes ``epochs`` passes over its batch cut into
            ``minibatches`` parts (a divisor of ``trainer.batch_size``), one optimizer update
            each.
        frozen_policy_steps: the run's first trainer steps train the loss's state alone (the
            policy's learning rate is 0).
        init_state: ``init_state(policy, *, key) -> eqx.Module | None``: trainable state of the
            loss's own (a critic). The trainer then trains ``TrainedModel(policy, loss_state)``,
            checkpoints both, publishes and exports the policy alone, and passes the whole to
            the loss function.
        state_learning_rate: the peak learning rate of that state (``None``: the policy's).
        create_prepare_fn: ``create_prepare_fn(reference_model, train_model) -> fn(model,
            batches) -> tuple[dict[str, NamedArray], ...]``: called as ``create_loss_fn`` is;
            its ``fn`` runs once per trainer step before its updates, on all its minibatches,
            and returns per-token arrays for each (``TrainingBatch.prepared``): what the updates
            compare against (PPO's old values) or normalise over the whole step. The one place
            a whole-step statistic is computed: inside ``loss_fn`` it would be per micro-batch.
    """

    aggregation: str | tuple[str, int] = "token_mean"
    token_rewards: bool = False
    epochs: int = 1
    minibatches: int = 1
    frozen_policy_steps: int = 0
    init_state: Callable[..., Any] | None = None
    state_learning_rate: float | None = None
    create_prepare_fn: Callable[[Any, Any], Callable[..., Any]] | None = None

    def __post_init__(self) -> None:
        name, length = (
            (self.aggregation, 0) if isinstance(self.aggregation, str) else self.aggregation
        )
        if name not in LOSS_AGGREGATIONS or not isinstance(length, int) or length < 0:
            raise ValueError(
                f"LossPlan.aggregation is {self.aggregation!r}; use one of {LOSS_AGGREGATIONS} "
                "or (name, length) with a length of 0 or more"
            )
        for field, least in (("epochs", 1), ("minibatches", 1), ("frozen_policy_steps", 0)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"LossPlan.{field} is {value!r}; it must be an int >= {least}")
        for field in ("init_state", "create_prepare_fn"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"LossPlan.{field} must be callable or None")
        rate = self.state_learning_rate
        if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
            raise ValueError(f"LossPlan.state_learning_rate is {rate!r}; use a rate above 0")

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.minibatches


def loss_plan(module: Any) -> LossPlan:
    """Loss ``module``'s :class:`LossPlan`: the one place the framework reads what a loss
    asks for beyond its required members. A module that still declares the members the plan
    replaced (``update_epochs``, ``init_state``, ``aggregation``, ...) is refused with a
    ``TypeError`` saying how to migrate (docs/losses.md)."""
    kind = type(module).__name__
    old = [name for name in _OLD_LOSS_MEMBERS if hasattr(module, name)]
    if old:
        listed = ", ".join(f"{_RENAMED.get(name, name)}=..." for name in old)
        raise TypeError(
            f"loss module {kind} declares {', '.join(old)}: these are no longer read. Declare "
            f"them as one plan instead: `plan = marin_rl_core.LossPlan({listed})` (renamed: "
            "needs_token_rewards -> token_rewards, update_epochs -> epochs, "
            "update_minibatches -> minibatches); see docs/losses.md, 'Migrating a loss'"
        )
    plan = getattr(module, "plan", None)
    if plan is None:
        return LossPlan()
    if not isinstance(plan, LossPlan):
        raise TypeError(
            f"loss module {kind}'s plan is a {type(plan).__name__}; make it a "
            "marin_rl_core.LossPlan"
        )
    return plan
