"""Errors raised where nobody can catch them, kept off the console.

Restoring a damaged checkpoint fails in TensorStore's asyncio reads (levanter's loader); reads
still in flight then finish on TensorStore's threads and try to hand their result to the event
loop that already closed. Python reports that as an *unraisable* ``RuntimeError: Event loop is
closed``: a bare six-line traceback on the console, seconds after ``marinrl eval`` said, rightly,
that the checkpoint was damaged and which one it used instead (issue 51: once in four tries
under load). Nothing is lost: the read's result was no longer wanted.

:func:`install` routes exactly those to the log (the run's log file while one is attached) and
leaves every other unraisable exception to Python's own report.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

_HARMLESS = (RuntimeError, "Event loop is closed")


def _is_harmless(unraisable: Any) -> bool:
    kind, text = _HARMLESS
    return isinstance(unraisable.exc_value, kind) and str(unraisable.exc_value) == text


def install() -> None:
    """Route unraisable ``RuntimeError: Event loop is closed`` reports to the log (debug) for
    the rest of the process; other unraisable exceptions go to the hook there was."""
    previous = sys.unraisablehook
    if getattr(previous, "_marinrl", False):
        return

    def hook(unraisable: Any) -> None:
        if _is_harmless(unraisable):
            logger.debug(
                "a late callback found its event loop closed (%s); ignored",
                unraisable.object,
                exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
            )
            return
        previous(unraisable)

    hook._marinrl = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


__all__ = ["install"]
