"""Every call a rollout worker makes into an env or an agent program, bounded in one place.

:class:`EnvCalls` runs them for the episode runner (``reset``, ``step``, ``score``) and for agent
episodes (``run_agent``, ``score``):

* :meth:`EnvCalls.call`: one call. A plain function runs on a thread of the helper's pool, an
  ``async def`` is awaited on the event loop; either is cut off at ``timeout`` seconds
  (``episodes.step_timeout_s``; for a plain call counted from when it starts on a thread, so a
  call queued behind other episodes' calls does not use up its step time) and at the episode's
  ``deadline`` (``episodes.episode_timeout_s``, however long it queued).
* :meth:`EnvCalls.call_each`: many plain calls in order on one thread (a single-turn batch's
  ``score`` calls: one thread round trip for the batch, not one per episode), each bounded the
  same way; a call cut off fails alone and the calls after it go on on a new thread.

A call cut off raises (or returns) :class:`~marin_rl_core.rollout.episode_state.EpisodeFailure`
``"timeout"``, a call that raises ``"error"``: it fails its episode and nothing else. A plain
call cut off leaves its thread behind (it ends if the call ever returns), counted in
:attr:`EnvCalls.hung_threads`; past :data:`~marin_rl_core.rollout.env_threads.MAX_HUNG_THREADS`
the env is not called again in this worker (more would only pile up threads) and its calls fail
at once, saying so. Env processes (``episodes.env_processes``) are called through here too: a
step cut off kills its process (:mod:`~marin_rl_core.rollout.env_pool`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from marin_rl_core.rollout.env_threads import (
    MAX_HUNG_THREADS,
    DaemonThreadExecutor,
    DaemonThreadPool,
)
from marin_rl_core.rollout.episode_state import EpisodeFailure

logger = logging.getLogger(__name__)

FOREVER = float("inf")


class EnvCalls:
    """Bounded env calls (see the module docstring). ``name``: its threads' name."""

    def __init__(self, name: str = "marinrl-env-steps"):
        self.name = name
        self._pool: DaemonThreadPool | None = None  # sized by set_threads
        self._old_pools: list[DaemonThreadPool] = []  # their stuck threads still count
        self._ordered = DaemonThreadExecutor(name)  # call_each's thread
        self._stuck_ordered = 0
        self._said_stuck = False

    @property
    def hung_threads(self) -> int:
        """Threads stuck in calls that were cut off and have not returned since (a call that
        was only slow frees its thread when it returns)."""
        pools = [*self._old_pools, *([self._pool] if self._pool else [])]
        return self._stuck_ordered + sum(pool.stuck for pool in pools)

    def set_threads(self, size: int, *, grow_only: bool = False) -> None:
        """Run plain calls on ``size`` threads at most. ``grow_only``: a smaller ``size`` keeps
        the threads there are (a thread per episode of the largest batch so far, so that every
        episode's hung call times out at once)."""
        size = max(1, size)
        if self._pool is not None and grow_only:
            self._pool.size = max(self._pool.size, size)
        elif self._pool is None or self._pool.size != size:
            if self._pool is not None:
                self._pool.shutdown()
                self._old_pools.append(self._pool)
            self._pool = DaemonThreadPool(self.name, size)

    def close(self) -> None:
        self._ordered.shutdown()
        if self._pool is not None:
            self._pool.shutdown()

    def _refuse_when_stuck(self) -> None:
        if self.hung_threads < MAX_HUNG_THREADS:
            return
        message = (
            f"{self.hung_threads} env threads are stuck in calls that never returned (each cut "
            "off after episodes.step_timeout_s); the env is not called again in this worker. "
            "Fix the env's hanging call, or run it with episodes.env_processes > 0, whose stuck "
            "processes are replaced"
        )
        if not self._said_stuck:
            self._said_stuck = True
            logger.error("%s", message)
        raise EpisodeFailure("error", message)

    async def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None,
        deadline: float = FOREVER,
        spent: Callable[[float], None] | None = None,
    ) -> Any:
        """``fn(*args)``, bounded by ``timeout`` and ``deadline`` (a ``time.monotonic()``
        time); ``spent(seconds)`` is told the time inside the call, however it ended. Raises
        :class:`EpisodeFailure`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise EpisodeFailure("timeout", "the episode ran past episodes.episode_timeout_s")
        timeout = timeout or None
        if timeout is None or left < timeout:
            timeout = left if left != FOREVER else timeout
        on_thread = not inspect.iscoroutinefunction(fn)
        if on_thread:
            self._refuse_when_stuck()
            if self._pool is None:
                self.set_threads(1)
        pool = self._pool
        inside = [0.0]
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        worker: list[threading.Thread] = []

        def timed() -> Any:  # the time inside the call, not the wait for a thread
            worker.append(threading.current_thread())
            loop.call_soon_threadsafe(started.set)
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] = time.perf_counter() - start

        start = time.perf_counter()
        try:
            if on_thread:
                assert pool is not None
                call = asyncio.wrap_future(pool.submit(timed))
                # The step timeout runs from when the call starts on a thread, not while it
                # waits behind other episodes' calls (the episode deadline does).
                waiting = asyncio.ensure_future(started.wait())
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait(
                        {waiting, call},
                        timeout=None if left == FOREVER else max(left, 0.0),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    waiting.cancel()
                if not started.is_set() and not call.done():
                    raise TimeoutError
            else:
                call = fn(*args)
            result = await asyncio.wait_for(call, timeout)
            if inspect.isawaitable(result):  # a plain function that returned an awaitable
                awaited = time.perf_counter()
                try:
                    result = await asyncio.wait_for(result, timeout)
                finally:
                    inside[0] += time.perf_counter() - awaited
        except TimeoutError:
            inside[0] = time.perf_counter() - start
            if on_thread and started.is_set() and pool is not None:
                # The thread is stuck in that call: it is left behind (counted until the call
                # returns, if ever), and another takes its place for the calls queued behind it.
                pool.abandon(worker[0])
            raise EpisodeFailure(
                "timeout",
                f"{getattr(fn, '__qualname__', fn)} did not return within {timeout:.1f} s",
            ) from None
        except EpisodeFailure:
            raise
        except Exception as exc:
            raise EpisodeFailure("error", f"{type(exc).__name__}: {exc}") from exc
        finally:
            if not on_thread:
                inside[0] = time.perf_counter() - start
            if spent is not None:
                spent(inside[0])
        return result

    async def call_each(
        self,
        fn: Callable[..., Any],
        calls: Sequence[tuple[Any, ...] | None],
        *,
        timeout: float | None,
        deadlines: Sequence[float],
        what: str,
    ) -> list[tuple[Any, float]]:
        """``fn(*args)`` for each ``args`` of ``calls`` in order on one thread (``None``: skip),
        each bounded by ``timeout`` from its start and by its own deadline. Returns each call's
        ``(result or EpisodeFailure, seconds inside it)`` (``(None, 0.0)`` for a skipped one).
        A call past its bound fails alone: the thread stuck in it is left behind and the calls
        after it go on on a new thread. ``what``: the call, for messages."""
        n = len(calls)
        outcomes: list[Any] = [None] * n
        spent = [0.0] * n
        current = [(-1, 0.0)]  # the call in progress: (its index, when it started)
        abandoned: set[int] = set()  # first indices of jobs whose thread was left behind

        def work(first: int) -> None:
            for j in range(first, n):
                if first in abandoned:
                    return
                args = calls[j]
                if args is None:
                    continue
                current[0] = (j, time.monotonic())
                start = time.perf_counter()
                try:
                    outcome: Any = fn(*args)
                except Exception as exc:  # noqa: BLE001 - fails this call only
                    outcome = EpisodeFailure("error", f"{type(exc).__name__}: {exc}")
                if first in abandoned:  # this call overran and was already failed
                    return
                outcomes[j], spent[j] = outcome, time.perf_counter() - start
            current[0] = (n, 0.0)

        if any(args is not None for args in calls):
            try:
                self._refuse_when_stuck()
            except EpisodeFailure as failure:
                return [(failure if a is not None else None, 0.0) for a in calls]
        step_timeout = timeout or FOREVER
        first = 0
        while first < n:
            job = asyncio.wrap_future(self._ordered.submit(work, first))
            while not job.done():
                index, since = current[0]
                if index >= n:  # the job is over; its future is about to say so
                    await job
                    continue
                if index < first:  # the job has not started its first call yet: look again soon
                    limit = min(deadlines[first] - time.monotonic(), 0.01)
                else:
                    limit = min(
                        since + step_timeout - time.monotonic(), deadlines[index] - time.monotonic()
                    )
                done, _ = await asyncio.wait(
                    {job}, timeout=None if limit == FOREVER else max(limit, 0)
                )
                if done or current[0][0] != index:
                    continue  # finished, or moved on to the next call: re-arm the timer
                if index < first:
                    if time.monotonic() < deadlines[first]:
                        continue
                    # The whole batch passed its deadline while queued.
                    abandoned.add(first)
                    for j in range(first, n):
                        outcomes[j] = EpisodeFailure(
                            "timeout", "the episode ran past episodes.episode_timeout_s"
                        )
                    first = n
                    break
                # Call ``index`` overran: it fails, its thread is left behind, the rest go on.
                abandoned.add(first)
                self._stuck_ordered += 1
                stuck = self._ordered
                self._ordered = DaemonThreadExecutor(self.name)
                stuck.hand_over(self._ordered)
                spent[index] = time.monotonic() - since
                outcomes[index] = EpisodeFailure(
                    "timeout",
                    f"{what} did not return within {step_timeout:.1f} s"
                    if since + step_timeout <= deadlines[index]
                    else "the episode ran past episodes.episode_timeout_s",
                )
                first = index + 1
                break
            else:
                first = n
        return list(zip(outcomes, spent))


__all__ = ["EnvCalls"]
