"""levanter's train step as :class:`~marin_rl_core.learner.step.Learner` runs it: a
``levanter.trainer.Trainer`` (:func:`levanter_trainer`) whose step is compiled with
``eqx.filter_jit`` (:class:`StepJit`) instead of haliax's ``named_jit``, with the step-wide loss
weights of a batch scaled for gradient accumulation over micro-batches, and the levanter tracker
(:class:`CaptureTracker`) that hands the metrics the step logs back to the learner."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


class StepJit:
    """levanter's train step (``Trainer._train_step``) compiled with ``eqx.filter_jit`` instead
    of haliax's ``named_jit``, called like levanter calls its ``_jit_train_step_fn``.

    ``named_jit`` works out the output shardings on every call: it flattens and hashes the whole
    train state and evaluates the step's output shapes, ~8 ms of Python per step on the default
    task (a quarter of the step on CPU). It needs none of that here: the step already constrains
    its result to the parameter sharding (``hax.shard_with_axis_mapping`` at its end) and its
    inputs arrive sharded, so XLA keeps the same layouts without being told. The state is
    donated, as levanter's ``donate_args=(True,)`` does, except its frozen parameters (a LoRA
    policy's base, once :func:`train_only` has set :attr:`is_trainable`): those enter the step
    as an argument it does not donate and do not come out of it, so the arrays stay the same
    from step to step and a colocated sampler samples from them while the state moves on (no
    copy of the base is made). ``tests/test_sharding.py`` checks the result and the parameters'
    sharding on four devices against one."""

    def __init__(self, step: Callable[..., Any], axis_mapping: Any, microbatch_rows: int | None):
        import equinox as eqx
        import haliax as hax

        self.is_trainable: Any = True
        """levanter's filter of the trained parameters; the state's other parameters (frozen)
        are neither donated nor returned."""

        def body(inputs: tuple[Any, Any, Any], state: Any) -> Any:
            batch, kwargs, frozen = inputs
            batch = tuple(_for_accumulation(b, microbatch_rows) for b in batch)
            if frozen is None:
                with hax.axis_mapping(axis_mapping):
                    return step(state, batch, kwargs)
            with hax.axis_mapping(axis_mapping):
                result = step(eqx.combine(state, frozen), batch, kwargs)
            kept = eqx.filter(result.new_state, self._mask(result.new_state))
            return dataclasses.replace(result, new_state=kept)

        # Donate every argument but the first: the state, not the batch nor the frozen part.
        self._jit = eqx.filter_jit(body, donate="all-except-first")

    def _mask(self, state: Any) -> Any:
        from marin_rl_core.models.lora import saved_part

        return saved_part(state, self.is_trainable)

    def _split(self, state: Any) -> tuple[Any, Any]:
        """``(trained, frozen)`` parts of ``state`` (the frozen one ``None`` when all train)."""
        import equinox as eqx

        if self.is_trainable is True:
            return state, None
        return eqx.partition(state, self._mask(state))

    def __call__(self, state: Any, batch: Any, batch_kwargs: Any) -> Any:
        import equinox as eqx

        trained, frozen = self._split(state)
        result = self._jit((batch, batch_kwargs, frozen), trained)
        if frozen is None:
            return result
        return dataclasses.replace(result, new_state=eqx.combine(result.new_state, frozen))

    def lower(self, state: Any, batch: Any, batch_kwargs: Any) -> Any:
        """JAX's ``Lowered`` step (``.compile().memory_analysis()``, ``.as_text()``)."""
        trained, frozen = self._split(state)
        return self._jit.lower((batch, batch_kwargs, frozen), trained).lowered


def _for_accumulation(batch: Any, microbatch_rows: int | None) -> Any:
    """``batch`` with its step-wide loss weights (``TrainingBatch.loss_weight``) scaled by the
    number of micro-batches it is cut into: levanter averages the micro-batches' losses,
    gradients and mean metrics, and weights that sum over the whole step need a sum."""
    import equinox as eqx

    if getattr(batch, "loss_weight", None) is None or not microbatch_rows:
        return batch
    steps = batch.Batch.size // microbatch_rows
    if steps <= 1:
        return batch
    return eqx.tree_at(
        lambda b: (b.loss_weight, b.token_weight),
        batch,
        (batch.loss_weight * steps, batch.token_weight * steps),
    )


def levanter_trainer(*args: Any, **kwargs: Any) -> Any:
    """A ``levanter.trainer.Trainer`` whose train step is a :class:`StepJit`."""
    import functools

    import levanter.trainer

    trainer = levanter.trainer.Trainer(*args, **kwargs)
    # levanter builds these lazily (cached properties); set them first. With hooks due (the
    # gradient-norm watch runs every step) levanter calls the first, else the second.
    rows = trainer.config.microbatch_size
    trainer.__dict__["_jit_train_step_fn"] = StepJit(
        trainer._train_step, trainer.parameter_axis_mapping, rows
    )
    trainer.__dict__["_jit_train_step_fn_no_hook"] = StepJit(
        functools.partial(trainer._train_step, _no_hooks=True), trainer.parameter_axis_mapping, rows
    )
    return trainer


def train_only(trainer: Any, is_trainable: Any) -> None:
    """Have levanter ``trainer``'s step differentiate the loss with respect to the parameters
    ``is_trainable`` marks only. levanter's step takes the gradient of the whole model and drops
    the frozen parameters' part afterwards: for a LoRA policy that is a gradient the size of the
    base model computed, accumulated over micro-batches and counted in the gradient norm, for
    nothing. Here the frozen parameters enter the loss as constants of the differentiated
    function; their gradients are never formed. Nor does the step donate them
    (:class:`StepJit`)."""
    import equinox as eqx

    compute = trainer._compute_gradients_microbatched

    def compute_trainable(loss_fn: Any, model: Any, *batch: Any, **kwargs: Any) -> Any:
        trainable, frozen = eqx.partition(model, is_trainable)

        def loss_of(part: Any, *args: Any, **kw: Any) -> Any:
            return loss_fn(eqx.combine(part, frozen), *args, **kw)

        return compute(loss_of, trainable, *batch, **kwargs)

    trainer._compute_gradients_microbatched = compute_trainable
    for name in ("_jit_train_step_fn", "_jit_train_step_fn_no_hook"):
        trainer.__dict__[name].is_trainable = is_trainable


class CaptureTracker:
    """A levanter tracker that keeps the metrics levanter's train step logs, for our own rows."""

    name = "marinrl-capture"

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}

    def init(self, run_id: str | None) -> CaptureTracker:  # levanter's TrackerConfig API
        return self

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        pass

    def log(self, metrics: Any, *, step: int | None, commit: bool | None = None) -> None:
        self.latest.update(metrics)

    def log_summary(self, metrics: dict[str, Any]) -> None:
        pass

    def log_artifact(
        self, artifact_path: Any, *, name: str | None = None, type: str | None = None
    ) -> None:
        pass

    def finish(self) -> None:
        pass
