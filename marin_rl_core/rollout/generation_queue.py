"""The one generation queue of a rollout worker: every source of generation requests (the episode
runner's cohorts, the agent endpoint's calls) submits here, and one thread feeds the engine.

Whatever is waiting when the engine comes free goes into one ``generate`` call: requests of
different sources, temperatures, budgets and stop ids share it (each keeps its own settings and
key, so a request's samples do not depend on what it was batched with). A source that submits
while the engine works waits for the next call, which takes everything that gathered meanwhile.

An engine with a ``serve(poll)`` method (the ``kv`` engine,
:meth:`~marin_rl_core.rollout.kv_engine.KVCacheEngine.serve`) is fed continuously instead: a
submission joins the rows already decoding at the engine's next round, and gets its samples as
soon as its own rows finish.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from marin_rl_core.generation import GenerationRequest, Sample

logger = logging.getLogger(__name__)


class GenerationQueue:
    """Feeds ``engine.generate`` from any thread (see the module docstring).

    Args:
        engine: a :class:`~marin_rl_core.protocols.GenerationEngine`; only this queue's thread
            calls its ``generate``.
        name: the thread's name.
    """

    def __init__(self, engine: Any, *, name: str = "marinrl-generate"):
        self.engine = engine
        self._pending: list[tuple[list[GenerationRequest], concurrent.futures.Future[Any]]] = []
        self._lock = threading.Condition()
        self._closed = False
        self.calls = 0  # engine.generate calls made
        self.submissions = 0  # submit() calls they served
        self.seconds = 0.0  # time inside engine.generate
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, requests: Sequence[GenerationRequest]
    ) -> concurrent.futures.Future[list[list[Sample]]]:
        """Queue ``requests``; the future holds their samples (``result[i][k]``: the ``k``-th
        sample of ``requests[i]``), or the error the engine raised for the call they were in."""
        future: concurrent.futures.Future[list[list[Sample]]] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the generation queue is closed"))
                return future
            self._pending.append((list(requests), future))
            self._lock.notify()
        return future

    def close(self) -> None:
        """Stop taking requests; those waiting fail, a call in progress finishes."""
        with self._lock:
            self._closed = True
            waiting, self._pending = self._pending, []
            self._lock.notify()
        for _, future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the generation queue is closed"))

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
            serve = getattr(self.engine, "serve", None)
            if serve is not None:
                start = time.perf_counter()
                try:
                    serve(self._poll)  # until nothing waits and nothing decodes
                except BaseException:  # noqa: BLE001 - its submissions were told; go on
                    logger.exception("the generation engine failed")
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1
                continue
            batch = self._poll()
            if batch:
                self._generate(batch)

    def _poll(self) -> list[tuple[list[GenerationRequest], concurrent.futures.Future[Any]]]:
        """The submissions waiting now (taken off the queue), cancelled ones left out."""
        with self._lock:
            batch, self._pending = self._pending, []
        batch = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
        self.submissions += len(batch)
        return batch

    def _generate(
        self, batch: list[tuple[list[GenerationRequest], concurrent.futures.Future[Any]]]
    ) -> None:
        requests = [request for own, _ in batch for request in own]
        start = time.perf_counter()
        try:
            out = self.engine.generate(requests)
        except ValueError as exc:
            if len(batch) == 1:
                _fail(batch, exc)
                return
            # A request the engine refuses (too long a prompt, say) fails its own source only.
            for one in batch:
                self._generate([one])
            return
        except BaseException as exc:  # noqa: BLE001 - each waiting source gets it
            _fail(batch, exc)
            return
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1
        at = 0
        for own, future in batch:
            future.set_result(out[at : at + len(own)])
            at += len(own)


def _fail(batch: list[tuple[Any, concurrent.futures.Future[Any]]], exc: BaseException) -> None:
    for _, future in batch:
        future.set_exception(exc)


__all__ = ["GenerationQueue"]
