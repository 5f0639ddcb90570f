"""One trainer step as optimizer updates (:class:`StepUpdates`): what the
:class:`~marin_rl_core.learner.trainer.Trainer` does with the rollouts of a step.

The step's rollouts become training batches: one, or the loss's minibatches (a random partition,
seeded by the run's seed and the step), each packed or padded into one of few shapes, each row
tempered as its lesson sampled it. The loss's whole-step preparation runs on them, then the loss's
epochs over them, one optimizer update per batch (:class:`~marin_rl_core.protocols.LossPlan`:
``epochs`` x ``minibatches``), and the step's metrics are combined over its updates. An update
whose loss or gradient norm is not finite stops the step with :class:`NonFiniteUpdate`.

Also the train step traced in the background while the first rollouts are generated
(:meth:`StepUpdates.start_warm_up`)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.learner.loss import batch_options
from marin_rl_core.learner.step import Learner, all_finite, metric_reduction
from marin_rl_core.protocols import LossPlan
from marin_rl_core.types import Rollout

logger = logging.getLogger(__name__)


class WarmUp:
    """The train step's warm-up (:meth:`StepUpdates.start_warm_up`), running."""

    def __init__(self, thread: threading.Thread, cancelled: threading.Event):
        self.thread, self.cancelled = thread, cancelled

    def finish(self) -> None:
        """The first batch is here: stop waiting to start (its step traces itself), or wait for
        the tracing to end (never trace the same step twice at once)."""
        self.cancelled.set()
        self.thread.join()


class NonFiniteUpdate(Exception):
    """An update of the step whose loss or gradient norm was NaN or infinite; the state it was
    given is donated, so the trainer stops (with
    :class:`~marin_rl_core.learner.trainer.TrainingDivergedError`).

    Args:
        bad: the values that are not finite (``"loss"``, ``"grad_norm"``).
        metrics: the update's metrics, its loss among them.
        where: which update, for a step of several (``" (epoch 2, update 3)"``; else ``""``).
        params_finite: whether the parameters were finite before the update.
    """

    def __init__(
        self, bad: list[str], metrics: dict[str, float], *, where: str, params_finite: bool
    ):
        super().__init__(f"non-finite {', '.join(bad)}{where}")
        self.bad, self.metrics, self.where = bad, metrics, where
        self.params_finite = params_finite


class StepUpdates:
    """See the module docstring.

    Args:
        config: the resolved run config.
        plan: the loss's plan (its epochs and minibatches, and what its batches hold).
        learner: runs each update.
        pad_id: the tokenizer's padding token.
    """

    def __init__(self, config: RLJobConfig, plan: LossPlan, learner: Learner, *, pad_id: int):
        self.config = config
        self.plan = plan
        self.learner = learner
        self._pad_id = pad_id
        self._temperature = {
            lesson.id: config.sampling_for(lesson).temperature
            for lesson in config.curriculum.lessons
        }

    @property
    def minibatch_size(self) -> int:
        """Rollouts per optimizer update: the batch, or its part when the loss cuts it into
        minibatches (config validation checks that they divide it)."""
        return self.config.trainer.batch_size // self.plan.minibatches

    def row_multiple(self, size: int) -> int:
        """Packed batches of ``size`` rollouts have a multiple of this many rows (or ``size``
        rows, which :func:`~marin_rl_core.learner.training_batch.training_batch_from_rollouts`
        never exceeds): an eighth of the batch (so at most nine shapes compile), and whole
        micro-batches and data-parallel shards."""
        t = self.config.trainer
        unit = t.microbatch_size or self.learner.sizes["batch_shards"]
        return math.lcm(max(1, size // 8), unit)

    def training_batch(
        self, rollouts: list[Rollout], advantages: np.ndarray, *, longest: int | None = None
    ) -> Any:
        """The training batch of one optimizer update (``minibatch_size`` rollouts at most);
        ``longest``: trimmed rows as long as for a rollout of that many tokens, at least (what
        the warm-up's batch of no rollouts is given)."""
        from marin_rl_core.learner.training_batch import training_batch_from_rollouts
        from marin_rl_core.models.packing import row_length

        # Behaviour logprobs are of the tempered distribution; the loss tempers each row alike.
        temperature = [self._temperature[r.lesson_id] for r in rollouts]
        max_seq_len = self.config.model.max_seq_len
        trim = self.config.trainer.trim_rows
        if trim and longest is not None and not rollouts:
            max_seq_len, trim = row_length(longest, max_seq_len), False
        return training_batch_from_rollouts(
            rollouts,
            advantages,
            max_seq_len,
            self._pad_id,
            temperature=temperature,
            batch_size=self.minibatch_size,
            pack=self.config.trainer.pack_rollouts,
            row_multiple=self.row_multiple(self.minibatch_size),
            trim=trim,
            **batch_options(self.plan),
        )

    def minibatches(
        self, rollouts: list[Rollout], advantages: np.ndarray, *, step: int
    ) -> list[Any]:
        """The step's training batches: one, or the loss's minibatches (a random partition of
        the rollouts, the same for every epoch of the step; seeded by the run's seed and the
        step, so a resumed run cuts a step as the uninterrupted one did)."""
        parts = self.plan.minibatches
        if parts == 1:
            return [self.training_batch(rollouts, advantages)]
        order = np.random.default_rng([self.config.seed, step]).permutation(len(rollouts))
        return [
            self.training_batch([rollouts[i] for i in idx], advantages[idx])
            for idx in np.array_split(order, parts)
        ]

    def run(self, state: Any, batches: list[Any], *, step: int) -> tuple[Any, dict[str, float]]:
        """Step ``step``'s updates on ``batches`` (:meth:`minibatches`) from ``state`` (donated),
        after the loss's preparation: ``(new_state, metrics)``, the metrics host floats combined
        over the updates (counts summed over one pass, extremes kept, others averaged).

        Raises:
            NonFiniteUpdate: an update's loss or gradient norm is not finite.
        """
        batches = self.learner.prepare(state, batches)
        rng = np.random.default_rng([self.config.seed, step, 1])
        totals: dict[str, list[float]] = {}
        updates = 0
        for epoch in range(self.plan.epochs):
            order = rng.permutation(len(batches)) if epoch else range(len(batches))
            for i in order:
                # (read before the update, which donates them: a reduction, cheap beside a step)
                finite = all_finite(state.model)
                state, loss, out = self.learner.step(state, batches[i])
                out["loss"] = loss
                bad = [k for k in ("loss", "grad_norm") if k in out and not math.isfinite(out[k])]
                if bad:
                    many = self.plan.updates_per_step > 1
                    where = f" (epoch {epoch + 1}, update {updates + 1})" if many else ""
                    raise NonFiniteUpdate(bad, out, where=where, params_finite=finite)
                for name, value in out.items():
                    totals.setdefault(name, []).append(value)
                updates += 1
        # Over the step's updates: counts summed over one pass, extremes kept, others averaged.
        combine = {
            "sum": lambda v: sum(v) / self.plan.epochs, "max": max, "min": min,
            "mean": lambda v: sum(v) / len(v),
        }  # fmt: skip
        return state, {name: combine[metric_reduction(name)](v) for name, v in totals.items()}

    def start_warm_up(
        self,
        state: Any,
        first_rollout_tokens: Callable[[threading.Event], int | None] | None = None,
    ) -> WarmUp | None:
        """Trace the train step in the background while the first rollouts are generated: the
        first step otherwise spends ~1 s of a 2-core machine tracing and lowering it after
        they arrive (issue 11). With ``trim_rows`` (rows as long as the batch's longest
        rollout, rounded up) its rows are as long as ``first_rollout_tokens`` says the first
        rollouts will be: the job asks the rollout workers' warm-up batch, sampled with the
        same weights (it waits for them, while they set up, unless the first batch comes
        first); without an answer, as short as a trimmed row gets (8 positions: short answers,
        as the default task has). Without ``trim_rows``, every batch's shapes; packed batches
        vary in rows, so they get none. A first batch of other shapes traces its own step as
        before: what the warm-up made goes unused, and no XLA compile is wasted on it (see
        :meth:`Learner.warm_up`)."""
        if self.config.trainer.pack_rollouts:
            return None
        cancelled = threading.Event()

        def warm_up() -> None:
            start = time.monotonic()
            tokens = None
            if first_rollout_tokens is not None and self.config.trainer.trim_rows:
                tokens = first_rollout_tokens(cancelled)
            if cancelled.is_set():
                return  # the first batch came first: its step traces itself
            batch = self.training_batch([], np.zeros(0, np.float32), longest=tokens)
            try:
                self.learner.warm_up(state, batch)
            except Exception:  # the first real step reports what is wrong, with its batch
                logger.debug("train step warm-up failed", exc_info=True)
                return
            logger.info(
                "train step traced in %.1f s for batches of %s rows x %s positions",
                time.monotonic() - start,
                batch.Batch.size,
                batch.Pos.size,
            )

        thread = threading.Thread(target=warm_up, name="marinrl-step-warm-up", daemon=True)
        thread.start()
        return WarmUp(thread, cancelled)
