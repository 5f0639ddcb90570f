"""What a server that forks (the local Ray's fork servers, :mod:`~marin_rl_core.job.worker_fork`
and :mod:`~marin_rl_core.job.fork_root`) needs around its ``fork``: the signal pipe that wakes
its loop, and a child's way out."""

from __future__ import annotations

import os
import selectors
import signal
import sys
import warnings
from typing import Any


class Wakeup:
    """SIGTERM and SIGCHLD wake a server's ``selector`` loop (through a pipe registered with it,
    data ``"wake"``): :attr:`stopped` once SIGTERM came."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.read, self.write = os.pipe()
        for fd in (self.read, self.write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.write)
        self.stopped = False
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
        selector.register(self.read, selectors.EVENT_READ, "wake")

    def _on_term(self, signum: int, frame: Any) -> None:
        self.stopped = True

    def drain(self) -> None:
        try:
            os.read(self.read, 4096)
        except BlockingIOError:
            pass

    def fork(self) -> int:
        """:func:`fork` with SIGTERM held in the child until its :meth:`close`: one sent to the
        child before then would reach this server's handler, copied into it, and be lost (a job
        stopping just after its server was forked waited 5 s for nothing, then killed it)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return pid

    def close(self) -> None:
        """In a child forked by :meth:`fork`: the signals back to their defaults, the pipe
        closed, and SIGTERM released (one sent since the fork ends the child now)."""
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.close(self.read)
        os.close(self.write)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def fork() -> int:
    """``os.fork()`` without Python 3.12's warning that the process is multi-threaded: it counts
    the native threads too, and a server has two besides its one Python thread, NumPy's
    OpenBLAS worker and pyarrow's jemalloc background thread, both of which their libraries stop
    or reset around a fork (``pthread_atfork``) so that the child holds none of their locks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        return os.fork()


def exit_when_done(body: Any) -> None:
    """In a forked child: run ``body()`` and ``os._exit`` with the status Python would give it
    (a ``SystemExit``'s code, its message printed; 1 and the traceback on stderr for any other
    error), without the interpreter's teardown of what the parent had imported."""
    code = 1
    try:
        body()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's own failure, as Python would print it
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
