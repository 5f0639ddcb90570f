"""A pool that runs untrusted programs in sandboxes, many at once, without blocking generation.

Each :meth:`SandboxPool.run` starts one supervisor process (:mod:`sandbox_supervisor`, a
standard-library script) that runs the given cases one after another, each in a fresh
temporary directory under limits (CPU time, wall time, memory, processes, file size, open
files) and, where the kernel allows, in new mount, network and PID namespaces: read-only file
system outside the case's directory, no network, and the case's whole process tree killed when
its program exits or outlives its wall time. :attr:`SandboxPool.isolation` says which held on
this machine (docs/plugins.md#code lists what is enforced where).

:meth:`SandboxPool.arun` is the same for async code (an env's ``async def step``): the
supervisor runs on one of the pool's ``max_concurrent`` threads, so an episode waiting on its
program holds up no other episode and no generation call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

logger = logging.getLogger(__name__)

SUPERVISOR = Path(__file__).with_name("sandbox_supervisor.py")
SYNTAX_EXIT = 121
"""The exit code with which a harness says its program does not compile (see code_env)."""

ESCAPE_FILE = "/tmp/marinrl-sandbox-escape.txt"
ATTACKS = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    ),
    "memory hog": "hog = bytearray(16 * 2**30)\n",
    "ignores SIGTERM": (
        "import os, signal, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(3600)\n"
    ),
    "writes outside its directory": f"open({ESCAPE_FILE!r}, 'w').write('escaped')\n",
    "opens a socket": (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2).sendall(b'hi')\n"
    ),
}
"""Hostile programs the sandbox is tested (tests/test_code_env.py) and measured
(bench/code_sandbox.py) against: each must end within its limits, earn nothing, and leave no
process, file (:data:`ESCAPE_FILE`) or connection behind."""


@attrs.frozen(kw_only=True)
class SandboxLimits:
    """Limits on each program the sandbox runs.

    Args:
        cpu_s: CPU seconds (``RLIMIT_CPU``, per process).
        wall_s: wall-clock seconds of the whole case, its children included.
        memory_mb: address space per process (``RLIMIT_AS``).
        processes: processes the case may run at once (a ``pids`` cgroup where one can be
            made, else ``RLIMIT_NPROC`` for a user other than root).
        file_mb: the largest file it may write (``RLIMIT_FSIZE``; its output files too).
        open_files: file descriptors per process.
        output_kb: how much of its standard output and error is kept.
    """

    cpu_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    wall_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    memory_mb: int = attrs.field(default=1024, validator=attrs.validators.ge(64))
    processes: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    file_mb: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    open_files: int = attrs.field(default=64, validator=attrs.validators.ge(16))
    output_kb: int = attrs.field(default=64, validator=attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class Case:
    """One program run: ``files`` written into its fresh directory, ``argv`` given to
    ``python -I``, ``stdin`` as its standard input."""

    files: Mapping[str, str]
    argv: Sequence[str] = ("program.py",)
    stdin: str = ""


@attrs.frozen(kw_only=True)
class Execution:
    """What one case did.

    Args:
        status: ``ok`` (exit 0), ``error`` (another exit), ``syntax_error`` (exit
            :data:`SYNTAX_EXIT`), ``timeout`` (wall or CPU time), ``memory`` (a
            ``MemoryError``), ``output_limit`` (a file over ``file_mb``), or ``skipped`` (not
            run: an earlier case of the same call timed out).
        exit_code: its exit code (128 + the signal that killed it, as shells write it).
        stdout, stderr: the first ``output_kb`` of each.
        seconds: wall time.
    """

    status: str
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program it ran): its supervisor could not start or
    died. The message says what happened."""


def _exit_code(result: Mapping[str, Any]) -> int:
    """The supervisor's exit code and signal as one code, 128 + the signal as shells write it."""
    return 128 + int(result["signal"]) if result["signal"] else int(result["exit_code"])


def _status(result: Mapping[str, Any]) -> str:
    code = _exit_code(result)
    if result["timed_out"] or code == 128 + signal.SIGXCPU or code == 128 + signal.SIGKILL:
        return "timeout"
    if code == 128 + signal.SIGXFSZ:
        return "output_limit"
    if code == 0:
        return "ok"
    if code == SYNTAX_EXIT:
        return "syntax_error"
    if "MemoryError" in result["stderr"][-300:]:
        return "memory"
    return "error"


class SandboxPool:
    """Runs :class:`Case` lists in sandboxes, up to ``max_concurrent`` lists at once.

    Args:
        limits: the limits of every program.
        max_concurrent: supervisors running at once (0: the machine's CPU count).
        python: the interpreter programs run with (default: this one; its standard library
            and site-packages are readable, read-only, inside the sandbox).
    """

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        *,
        max_concurrent: int = 0,
        python: str = sys.executable,
    ):
        self.limits = limits
        self.python = python
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        self._threads = concurrent.futures.ThreadPoolExecutor(
            self.max_concurrent, thread_name_prefix="code-sandbox"
        )
        self._isolation: dict[str, Any] | None = None

    @property
    def isolation(self) -> dict[str, Any]:
        """What the sandbox enforces on this machine (found by running a trivial program once):
        ``network``, ``pid_namespace``, ``read_only_fs`` (bools) and ``process_limit``
        (``cgroup``, ``rlimit`` or ``none``)."""
        if self._isolation is None:
            self._supervise([Case(files={"program.py": "pass"})])
        return dict(self._isolation or {})

    def run(self, cases: Sequence[Case], *, stop_after_timeout: bool = True) -> list[Execution]:
        """Run ``cases`` one after another in one supervisor; block until done.

        With ``stop_after_timeout`` the cases after one that timed out are not run (status
        ``skipped``), so that a program that loops costs one wall limit, not one per case.

        Raises:
            SandboxError: the sandbox itself failed.
        """
        return self._supervise(cases, stop_after_timeout=stop_after_timeout)

    async def arun(
        self, cases: Sequence[Case], *, stop_after_timeout: bool = True
    ) -> list[Execution]:
        """:meth:`run` on one of the pool's threads, awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._threads, lambda: self.run(cases, stop_after_timeout=stop_after_timeout)
        )

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _supervise(
        self, cases: Sequence[Case], *, stop_after_timeout: bool = True
    ) -> list[Execution]:
        limits = attrs.asdict(self.limits)
        request = {
            "cases": [
                {"files": dict(c.files), "argv": list(c.argv), "stdin": c.stdin} for c in cases
            ],
            "limits": limits,
            "python": self.python,
            "stop_after_timeout": stop_after_timeout,
        }
        # The supervisor's own budget: every case's wall time plus start-up and clean-up.
        budget = len(cases) * (self.limits.wall_s + 2.0) + 10.0
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", str(SUPERVISOR)],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                timeout=budget,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as exc:
            raise SandboxError(
                f"the sandbox supervisor did not finish {len(cases)} case(s) in {budget:.0f} s"
            ) from exc
        if proc.returncode != 0:
            raise SandboxError(
                f"the sandbox supervisor failed (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-500:]}"
            )
        reply = json.loads(proc.stdout)
        executions = []
        for result in reply["results"]:
            if result.get("skipped"):
                executions.append(Execution(status="skipped"))
                continue
            if self._isolation is None:
                self._isolation = result["isolation"]
                logger.info("code sandbox on this machine: %s", describe(self._isolation))
            executions.append(
                Execution(
                    status=_status(result),
                    exit_code=_exit_code(result),
                    stdout=result["stdout"],
                    stderr=result["stderr"],
                    seconds=float(result["seconds"]),
                )
            )
        return executions


def describe(isolation: Mapping[str, Any]) -> str:
    """One line saying what the sandbox enforces, from :attr:`SandboxPool.isolation`."""
    said = [
        "no network" if isolation.get("network") else "NETWORK REACHABLE",
        "read-only file system outside the case's directory"
        if isolation.get("read_only_fs")
        else "FILE SYSTEM WRITABLE as this user",
        "process tree killed with its PID namespace"
        if isolation.get("pid_namespace")
        else "process tree killed by the keeper",
        {
            "cgroup": "process count limited by a pids cgroup",
            "rlimit": "process count limited by RLIMIT_NPROC",
        }.get(isolation.get("process_limit", ""), "PROCESS COUNT UNLIMITED (root, no cgroup)"),
    ]
    return "; ".join(said)
