"""When a rollout worker waits for newer weights and when it goes on: pacing, in one place.

A worker may generate, with the weights it has, its share of
``replay_buffer.max_generated_per_trained x trainer.batch_size`` rollouts per trainer step, up
to ``replay_buffer.max_rollout_step_delay`` steps past its newest weights; then it is *ahead*
and waits (:meth:`Pacer.wait`). Rollouts of one weight version count only up to what the
trainer can use before they go stale (``max_rollout_step_delay + 1`` steps' worth); the rest is
*surplus* (made because the trainer was short of rollouts), which the trainer may drop as stale
without the worker owing it anything.

While it waits the worker asks the trainer (:class:`PacingFeedback`, from
``Trainer.pacing_feedback``): rollouts of this worker the trainer dropped unused (stale after a
checkpoint or an eval held it up, or evicted) are generated again at once, first set against
the surplus; a trainer that has waited :data:`STARVED_S` with nothing arriving and has read
every batch this worker wrote is fed without newer weights (it lost rollouts it counted on),
unless it has published weights newer than the worker's (then it waits for the batch those
make: one made with older weights would arrive stale, as it did when a loaded machine took over
a second to hand newer weights over); a busy trainer (a first step compiling, a checkpoint) is
waited for, up to :data:`PACED_LIMIT_S` or four typical weight intervals. Without an answer
(no job around the worker, or the trainer gone) the wait ends after four typical intervals (at
least 2 s).

``tests/test_pacing.py`` drives every branch on a clock of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

STARVED_S = 1.0
"""A paced worker goes on when the trainer has waited this long with no rollouts arriving (the
trainer's reader polls every 0.5 s, so a batch already written has arrived by then)."""

PACED_LIMIT_S = 60.0
"""The longest a paced worker waits for newer weights while the trainer is busy (it goes on
after four typical weight intervals if those are longer)."""

NO_ANSWER_S = 2.0
"""Without answers from the trainer, a paced worker waits at least this long (or four typical
weight intervals)."""


class PacingFeedback(NamedTuple):
    """The trainer's answer to a paced worker (``Trainer.pacing_feedback``)."""

    starved_seconds: float
    """How long the trainer has waited for rollouts with none arriving (0 while it trains)."""
    dropped: int
    """How many of this worker's rollouts it dropped without training on them, ever."""
    read_through: int
    """The batch counter after the last of this worker's batches it has read."""
    published_step: int = -1
    """The step of the newest weights it has published (-1: none yet)."""


class Pacer:
    """One rollout worker's pacing (see the module docstring).

    Args:
        share: the worker's rollouts per trainer step (``max_generated_per_trained x
            batch_size / num_rollout_workers``); 0 turns pacing off.
        delay: ``replay_buffer.max_rollout_step_delay``.
        name: the worker, for the log.
        clock, sleep: time, for tests (default: ``time.monotonic`` and the stop event's wait).
    """

    def __init__(
        self,
        *,
        share: float,
        delay: int,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] | None = None,
    ):
        self.share, self.delay, self.name = share, delay, name
        self.ask: Callable[[], PacingFeedback | tuple[Any, ...]] | None = None
        """The trainer's answer (set by the job; ``None``: no trainer to ask)."""
        self._clock, self._sleep = clock, sleep
        self._paced_from: int | None = None  # the weight step pacing counts from
        self._generated_at: dict[int, int] = {}  # training rollouts made per weight step
        self.usable = 0.0  # of those, what the trainer can use before they go stale
        self.surplus = 0  # training rollouts made past what pacing counts
        self.written_through = 0  # the batch counter after the last batch written to storage
        self._dropped_seen = 0  # of the trainer's drops, the ones already accounted for
        self.weight_interval = 0.0  # typical seconds between weight updates (a moving mean)
        self._last_weights_at: float | None = None
        self._logged = False

    def weights_arrived(self) -> None:
        """Note newer weights (the typical interval between them bounds the waits)."""
        now = self._clock()
        if self._last_weights_at is not None:
            interval = now - self._last_weights_at
            self.weight_interval = (
                interval
                if not self.weight_interval
                else 0.8 * self.weight_interval + 0.2 * interval
            )
        self._last_weights_at = now

    def ahead(self, weight_step: int) -> bool:
        """Whether the worker has generated all it may with the weights of ``weight_step``
        (``-1``: none yet, never ahead)."""
        if not self.share or weight_step < 0:
            return False
        if self._paced_from is None:
            self._paced_from = weight_step
        return self.usable >= (weight_step - self._paced_from + 1 + self.delay) * self.share

    def count_generated(self, n: int, step: int) -> None:
        """Count ``n`` training rollouts made with the weights of ``step`` (a batch's first
        when later ones joined it, ``episodes.in_flight_weights``): a weight version counts
        only up to ``delay + 1`` steps' worth, the rest is surplus."""
        cap = (self.delay + 1) * self.share
        before = self._generated_at.get(step, 0)
        self._generated_at[step] = before + n
        counted = min(before + n, cap) - min(before, cap)
        self.usable += counted
        self.surplus += n - counted

    def wait(
        self, weight_step: Callable[[], int], sync: Callable[[], bool], stop: threading.Event
    ) -> float:
        """Wait while the worker is ahead at ``weight_step()``, calling ``sync()`` (newer
        weights, if published: ``True``) and asking the trainer (:attr:`ask`), until newer
        weights, a trainer's answer or a bound lets it go on, or ``stop`` is set. Returns the
        seconds waited."""
        sleep = self._sleep or stop.wait
        start = self._clock()
        fallback = max(NO_ANSWER_S, 4 * self.weight_interval)
        limit = max(PACED_LIMIT_S, 4 * self.weight_interval)
        asked = None
        while self.ahead(weight_step()) and not stop.is_set():
            if sync():
                continue
            now = self._clock()
            waited = now - start
            if self.ask is not None and (
                asked is None or (waited >= STARVED_S and now - asked >= 0.1)
            ):
                asked = now
                try:
                    answer = PacingFeedback(*self.ask())
                except Exception:  # noqa: BLE001 - no answer: fall back to the plain bound
                    self.ask = None
                    continue
                if self._regenerate(answer.dropped):
                    continue
                arrived = answer.read_through >= self.written_through
                # Newer weights than the worker's are on their way to it: what the trainer
                # waits for is the batch made with them.
                newer = answer.published_step > weight_step()
                if (
                    answer.starved_seconds >= STARVED_S
                    and waited >= STARVED_S
                    and arrived
                    and not newer
                ):
                    self._log_once("the trainer is short of rollouts")
                    break
            bound = limit if self.ask is not None else fallback
            if waited > bound:
                self._log_once(f"no newer weights for {bound:.1f} s")
                break
            sleep(0.005)
        return self._clock() - start

    def _regenerate(self, dropped: int) -> bool:
        """Take the trainer's count of this worker's rollouts dropped unused: what is new and
        beyond the surplus is no longer usable (generated again). Whether that was any."""
        if dropped <= self._dropped_seen:
            return False
        new, self._dropped_seen = dropped - self._dropped_seen, dropped
        absorbed = min(new, self.surplus)
        self.surplus -= absorbed
        if new == absorbed:
            return False
        self.usable -= new - absorbed
        return True

    def _log_once(self, why: str) -> None:
        if not self._logged:
            self._logged = True
            logger.info(
                "worker %s: %s while paced; generating with the weights it has (logged once)",
                self.name,
                why,
            )
