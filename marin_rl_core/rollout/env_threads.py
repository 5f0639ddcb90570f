"""Threads for env calls that may hang: a daemon-thread executor whose stuck thread is left
behind (:class:`DaemonThreadExecutor`) and a pool of them that counts the stuck ones and stops
growing past :data:`MAX_HUNG_THREADS`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

# --- a thread that may hang ----------------------------------------------------------------------


class DaemonThreadExecutor(concurrent.futures.Executor):
    """One daemon thread running submitted calls in order. A call that hangs keeps this thread
    (the runner then starts a new executor), and, being a daemon, never blocks process exit as a
    ``ThreadPoolExecutor``'s thread would."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                future.set_exception(exc)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def hand_over(self, other: DaemonThreadExecutor) -> None:
        """Move the calls not yet started to ``other`` (this thread is stuck), and let this
        thread end should its call ever return."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                other._queue.put(item)
        self._queue.put(None)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)


MAX_HUNG_THREADS = 64
"""Threads stuck in env calls that never returned (each cut off by its timeout) a runner
tolerates; past it the env's calls fail at once, saying so: more would only pile up threads."""


class DaemonThreadPool:
    """Up to ``size`` daemon threads running submitted calls, any call on any idle thread. A
    call that hangs keeps its thread: :meth:`abandon` takes that thread out of the count, so
    another starts for the calls queued behind it."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = 0
        self._abandoned: set[threading.Thread] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        with self._lock:
            if self._idle <= 0 and self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
            else:
                self._idle -= 1  # that idle thread takes this call
        return future

    async def call(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None
    ) -> Any:
        """``fn(*args)`` on a thread of the pool, awaited for at most ``timeout`` seconds: a call
        cut off then (or cancelled) is left behind on its thread, which is :meth:`abandon` ed
        (it ends if the call ever returns)."""
        worker: list[threading.Thread] = []

        def run() -> Any:
            worker.append(threading.current_thread())
            return fn(*args)

        future = asyncio.wrap_future(self.submit(run))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except (TimeoutError, asyncio.CancelledError):
            if worker:
                self.abandon(worker[0])
            raise

    @property
    def stuck(self) -> int:
        """Threads still stuck in calls that were cut off."""
        with self._lock:
            return len(self._abandoned)

    def abandon(self, thread: threading.Thread) -> None:
        """``thread`` is stuck in a call: it ends if the call ever returns, and no longer
        counts against ``size``."""
        with self._lock:
            if thread not in self._abandoned:
                self._abandoned.add(thread)
                self._threads -= 1
                if self._idle < 0:  # a queued call waits for a thread: start one
                    self._idle += 1
                    self._threads += 1
                    threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                    future.set_exception(exc)
            with self._lock:
                if me in self._abandoned:
                    self._abandoned.discard(me)
                    return
                self._idle += 1

    def shutdown(self) -> None:
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)
