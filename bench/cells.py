"""Measurements in a child process, so that a bench stops when told.

A compiled JAX call runs to its end before Python sees a signal: ``timeout``'s SIGTERM or a
Ctrl-C in the middle of a long generation waited minutes for it. A bench built on this module
runs itself again as a child (``in_child()`` is then true) that does the measuring and reports
each finished cell with :func:`emit`; the parent echoes the child's output, keeps the cells, and
on SIGTERM or Ctrl-C kills the child's whole process group at once and returns what arrived, so
the bench prints the table of what finished within seconds, mid-cell too.

    if cells.in_child():
        measure(args)                      # calls cells.emit(name=..., rate=...) per cell
        return
    records, stopped = cells.run_in_child()
    print_table(records)

A bench that prints its figures as it measures them runs its whole measuring in the child
instead: ``cells.measure_in_child(measure, args)``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_CHILD = "MARINRL_BENCH_CHILD"
_PREFIX = "@cell "


def in_child() -> bool:
    """Whether this process is the measuring child of :func:`run_in_child`."""
    return os.environ.get(_CHILD) == "1"


def emit(**record: Any) -> None:
    """Report one finished measurement to the parent (a JSON line on stdout)."""
    print(_PREFIX + json.dumps(record), flush=True)


def run_in_child() -> tuple[list[dict[str, Any]], bool]:
    """Run this script again, with the same arguments, as the measuring child; echo its output
    and collect what it :func:`emit`\\ s. Returns ``(records, stopped)``: ``stopped`` when a
    SIGTERM or Ctrl-C ended the measuring early or the child failed (its error is on stderr)."""
    records: list[dict[str, Any]] = []
    child = subprocess.Popen(
        [sys.executable, *sys.argv],
        env={**os.environ, _CHILD: "1"},
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        start_new_session=True,  # its own process group: killed whole, compile threads and all
    )
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    stopped = False
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(_PREFIX):
                records.append(json.loads(line[len(_PREFIX) :]))
            else:
                print(line, end="", flush=True)
        if child.wait() != 0:
            print(f"the measuring process failed (exit {child.returncode})", file=sys.stderr)
            stopped = True
    except KeyboardInterrupt:
        stopped = True
        print("stopped (time limit or Ctrl-C): what finished is reported, the rest not", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
    return records, stopped


def measure_in_child(measure: Callable[..., Any], *args: Any) -> bool:
    """``measure(*args)`` in the measuring child, for a bench that prints its figures as it goes:
    a time limit or Ctrl-C ends it at once, the figures printed so far standing. Returns
    ``stopped`` (see :func:`run_in_child`); in the child, ``False`` once ``measure`` returns."""
    if in_child():
        measure(*args)
        return False
    _, stopped = run_in_child()
    return stopped
