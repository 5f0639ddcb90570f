"""Developer sessions. `nox` runs the defaults (tests); `nox -s slow` runs the long ones."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"


def _install(session: nox.Session, extra: str) -> None:
    session.install("-e", f".[{extra}]")


def _test_halves() -> list[list[str]]:
    """The test files in two halves, each run by a pytest process of its own. The whole suite in
    one process (700+ tests, each leaving its XLA clients, Flight servers and the daemon threads
    the timeout tests leave stuck) has ended in a segfault in its last minutes, never a file run
    on its own (docs/development.md)."""
    from pathlib import Path

    files = sorted(str(p) for p in Path("tests").glob("test_*.py"))
    middle = len(files) // 2
    return [files[:middle], files[middle:]]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the fast test suite (everything not marked slow), in two pytest processes; with
    arguments (``nox -s tests -- tests/test_x.py -k y``), pytest on those alone."""
    _install(session, "test")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    for half in _test_halves():
        session.run("pytest", *half)


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
