"""What a server that forks (the local Ray's fork servers, :mod:`~marin_rl_core.job.worker_fork`
and :mod:`~marin_rl_core.job.fork_root`) needs around its ``fork``: the signal pipe that wakes
its loop, and a child's way out."""

from __future__ import annotations

import os
import selectors
import signal
import sys
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

    def close(self) -> None:
        """In a forked child: the signals back to their defaults, the pipe closed."""
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.close(self.read)
        os.close(self.write)


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
