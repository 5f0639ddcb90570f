"""How the agent endpoint (:mod:`~marin_rl_core.rollout.agent_server`) batches the calls of its
episodes into the worker's generation calls (:class:`CallBatcher`).

The calls of all running episodes wait together. A batch goes as soon as a cohort of the open
episodes (``1 / episodes.generation_cohorts`` of them) has a call waiting, so that one cohort's
calls gather while another's are sampled, or after a hold: ``episodes.agent_batch_window_s``, or
half the last generation call's time if that is longer (fuller calls for at most 1.5x the
latency). One generation call takes at most a cohort's share of calls; those that gathered past
it go in the next, so that calls' heights stay regular (fewer prefill shapes, less padding), as
in-process cohorts are. Calls of any temperature and length budget share a generation call,
each with its own.

Everything here runs on the endpoint's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import attrs

from marin_rl_core.generation import GenerationRequest


@attrs.define(eq=False)
class AgentCall:
    """One call waiting to be sampled: its episode (its key), prompt ids, one seed per choice,
    its settings (temperature, budget, stop ids) and the future its samples go to."""

    episode: str
    prompt: list[int]
    seeds: list[int]
    settings: tuple[float, int, tuple[int, ...]]
    future: asyncio.Future[Any]


class CallBatcher:
    """Batches :class:`AgentCall` s (see the module docstring).

    Args:
        submit: queues :class:`~marin_rl_core.generation.GenerationRequest` s, returns a
            ``concurrent.futures.Future`` of their samples (the worker's generation queue).
        batch_window_s: the least a first call waits for others.
        cohorts: ``episodes.generation_cohorts``.
        open_episodes: how many episodes are open now (thread-safe).
    """

    def __init__(
        self,
        submit: Callable[..., Any],
        *,
        batch_window_s: float,
        cohorts: int,
        open_episodes: Callable[[], int],
    ):
        self._submit = submit
        self.batch_window_s = batch_window_s
        self.cohorts = max(1, cohorts)
        self._open = open_episodes
        self.pending: list[AgentCall] = []
        self.wake: asyncio.Event | None = None  # made on the endpoint's loop
        self.generate_seconds = 0.0
        self.generate_calls = 0
        self.largest_call = 0  # the most agent calls one generation call served
        self._last_generate_s = 0.0

    def add(self, call: AgentCall) -> None:
        """Queue ``call`` (on the endpoint's loop)."""
        assert self.wake is not None, "the batcher runs on a started endpoint"
        self.pending.append(call)
        self.wake.set()

    def _cohort_waiting(self) -> bool:
        """Whether a cohort's share of the open episodes (all of them: ``cohorts = 1``) has a
        call waiting."""
        waiting = len({call.episode for call in self.pending})
        return waiting * self.cohorts >= self._open()

    async def run(self) -> None:
        """Batch and sample calls until cancelled."""
        assert self.wake is not None
        wake = self.wake
        while True:
            await wake.wait()
            wake.clear()
            if not self.pending:
                continue
            # Batch until a cohort of the open episodes has a call waiting (their calls trickle
            # in as the agents read the last replies, or start; while one cohort is sampled the
            # next gathers), or for the hold.
            hold = max(self.batch_window_s, 0.5 * self._last_generate_s)
            deadline = time.monotonic() + hold
            while not self._cohort_waiting():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), left)
                except TimeoutError:
                    break
            # At most a cohort's share per call: calls that gathered past it go in the next.
            largest = max(1, -(-self._open() // self.cohorts))
            calls, self.pending = self.pending[:largest], self.pending[largest:]
            self.largest_call = max(self.largest_call, len(calls))
            await self._sample(calls)  # each call's own settings: one generation call for all
            if self.pending:
                wake.set()

    async def _sample(self, calls: list[AgentCall]) -> None:
        requests = [
            GenerationRequest(
                prompt=call.prompt,
                temperature=call.settings[0],
                max_tokens=call.settings[1],
                stop_tokens=call.settings[2],
                seed=seed % 2**32,
            )
            for call in calls
            for seed in call.seeds
        ]
        start = time.perf_counter()
        try:
            out = await asyncio.wrap_future(self._submit(requests))
        except Exception as exc:  # noqa: BLE001 - each waiting call answers with it
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(exc)
            return
        finally:
            self._last_generate_s = time.perf_counter() - start
            self.generate_seconds += self._last_generate_s
            self.generate_calls += 1
        at = 0
        for call in calls:
            samples = [out[at + k][0] for k in range(len(call.seeds))]
            at += len(call.seeds)
            if not call.future.done():
                call.future.set_result(samples)


__all__ = ["AgentCall", "CallBatcher"]
