"""Developer sessions. `nox` runs the defaults (tests); `nox -s slow` runs the long ones."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

STATIC_PYTHONS = ("/usr/bin/python3.11", "/usr/local/bin/python3.11")
"""Where a Linux distribution's own ``python3.11`` is, linked statically (Debian's is)."""


def _shares_libpython(python: str) -> bool | None:
    """Whether ``python`` runs on a shared ``libpython`` (Linux); ``None`` where it did not
    answer (a broken interpreter is never picked)."""
    probe = "print(any('libpython' in line for line in open('/proc/self/maps')))"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    answer = out.stdout.strip()
    return {"True": True, "False": False}.get(answer) if out.returncode == 0 else None


def _python() -> str:
    """The sessions' interpreter: the first ``python3.11`` on ``PATH``, unless that one runs on
    a shared ``libpython`` (pyenv's builds do: every call into the interpreter goes through the
    library's symbol table) and the system has a statically linked 3.11 beside it, which then
    runs the sessions: on the 2-core machine the suite took 14:06-15:03 on Debian's 3.11.2
    against 15:39-16:07 on pyenv's 3.11.7, a pure-Python loop 1.01 against 1.48 s
    (docs/development.md#tests).
    ``nox -s tests --force-python python3.11`` takes the one on ``PATH`` all the same."""
    first = shutil.which("python3.11")
    if sys.platform != "linux" or first is None or _shares_libpython(first) is not True:
        return "3.11"
    for python in STATIC_PYTHONS:
        if os.access(python, os.X_OK) and _shares_libpython(python) is False:
            return python
    return "3.11"


PYTHON = _python()


def _install(session: nox.Session, extra: str) -> None:
    session.install("-e", f".[{extra}]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the fast test suite (everything not marked slow) in three pytest-xdist workers, a test
    file to a worker; with arguments (``nox -s tests -- tests/test_x.py -k y``), pytest on those
    alone in one process. Prints the wall time."""
    import time

    _install(session, "test")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    # Three workers on the 2-core machines this runs on: many tests use about one core (a job
    # whose trainer and sampler take turns, a test that waits for a timeout), and two workers
    # left ~20% of the machine idle; a third fills some of it (docs/development.md#tests).
    if PYTHON != "3.11":
        session.log(f"on {PYTHON}: statically linked, faster than the python3.11 on PATH")
    start = time.monotonic()
    # The package's bytecode written once: an editable install leaves it to each process's
    # imports, and where PYTHONDONTWRITEBYTECODE is set (these machines set it) every process the
    # suite starts compiled the sources it imports again (0.26 CPU-s for all of them).
    session.run("python", "-m", "compileall", "-q", "marin_rl_core", "plugins", silent=True)
    # Files in the order tests/conftest.py gives them (the longest first), not xdist's.
    session.run("pytest", "-n", "3", "--dist", "loadfile", "--no-loadscope-reorder")
    minutes, seconds = divmod(round(time.monotonic() - start), 60)
    session.log(f"the test suite took {minutes}:{seconds:02d}")


@nox.session(python=PYTHON, default=False)
def slow(session: nox.Session) -> None:
    """Run the long-running tests (training runs that must learn, the longest multi-process
    jobs; docs/development.md)."""
    _install(session, "test")
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session(python=PYTHON, default=False)
def cluster(session: nox.Session) -> None:
    """All the tests on a separately started Ray cluster (`ray start --head`, `--ray-address`),
    the two-node ones included (those are marked slow; the others run in `tests` too)."""
    _install(session, "test")
    session.run("pytest", "-m", "cluster", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Check style with ruff."""
    session.install("ruff>=0.6")
    session.run(
        "ruff", "check", "marin_rl_core", "plugins", "tests", "bench", "examples", "noxfile.py"
    )


@nox.session(python=PYTHON, default=False)
def typecheck(session: nox.Session) -> None:
    """Type-check the core and the built-in plugins with mypy."""
    _install(session, "dev")
    session.run("mypy", *session.posargs)
