"""What the raylet of a job's own local Ray runs to start each worker, in place of Ray's
``ray/_private/workers/setup_worker.py``.

The raylet starts every worker as ``python <this script> [--serialized-runtime-env-context=<json>]
--language=PYTHON <default_worker.py> <its arguments>`` (the context only where the worker has a
runtime env: for a worker without one, the raylet leaves out a script whose name ends in
``setup_worker.py``, Ray's own included, and ``exec``s the worker itself; hence this name).

Where the driver started the local Ray with a fork server (:mod:`marin_rl_core.job.worker_fork`;
its directory in ``MARINRL_WORKER_FORK``), a Python worker with no command prefix and no other
entry point is forked from it (:func:`run_forked`): this process stays the raylet's child for the
worker's life, passes signals on and exits as the worker did (the driver started the server
before Ray). Otherwise (or where the server does not take the worker), it does exactly what Ray's
script does for a Python worker, without importing Ray first: ``env_vars`` expanded as Ray's
``update_envs`` does, then ``exec`` of ``command_prefix`` + ``py_executable`` + the worker's
arguments (straight where the Python is a program's path and there is no prefix, through
``bash -c`` otherwise, as Ray does), with ``override_worker_entrypoint`` in place of the
worker's script. Anything else (another language, a context with fields this script does not
know) is handed to Ray's own script unchanged.

It is run as a script (``marin_rl_core`` is not imported).
:func:`marin_rl_core.job.local_ray.lean_loopback_head` installs it where Ray's own script takes
the two options it reads and no other (a later Ray's keeps its own).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys

KNOWN_FIELDS = frozenset(
    {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"}
)


def parse(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """``(context JSON, language, the worker's command)`` from the raylet's arguments, the two
    options read as Ray's ``argparse.parse_known_args`` reads them (either spelling, anywhere)."""
    context: str | None = None
    language: str | None = None
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--serialized-runtime-env-context", "--language"):
            if not eq:
                value = next(args, "")
            if name == "--language":
                language = value
            else:
                context = value
        else:
            rest.append(arg)
    return context, language, rest


def expand(value: str) -> str:
    """Ray's ``update_envs`` for one value: ``$X`` and ``${X}`` from the environment, unset
    ones (``${X}`` form) as the empty string."""
    return re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))


def is_program(python: str) -> bool:
    """Whether ``python`` names an executable file itself (not a command line for a shell)."""
    return (
        os.path.isabs(python)
        and not any(c.isspace() for c in python)
        and os.access(python, os.X_OK)
    )


def rays_own_script() -> str:
    """The path of Ray's own set-up script (found without importing Ray)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        raise ImportError("ray is not installed")
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "setup_worker.py")


def ray_own_setup_worker(argv: list[str]) -> None:
    """Hand over to Ray's own set-up script with the arguments the raylet gave."""
    os.execv(sys.executable, [sys.executable, rays_own_script(), *argv])


FORK_SERVER_ENV = "MARINRL_WORKER_FORK"
"""The directory of the job's fork server (:mod:`marin_rl_core.job.worker_fork`), where the
local Ray was started with one."""

FORK_SERVER_WAIT_S = 60.0
"""How long a worker waits for its fork server to be ready (it imports first) while the server
lives; then, or where it is gone, the worker is ``exec``'d as without one."""


def run_forked(directory: str, argv: list[str]) -> int | None:
    """Have the fork server in ``directory`` start the worker ``argv`` and wait for it,
    passing on SIGTERM, SIGINT and SIGHUP; returns its exit status (negative: the signal that
    ended it), or ``None`` where the server did not start it (the driver started the server,
    :mod:`marin_rl_core.job.worker_fork`; it may still be importing)."""
    import socket
    import struct
    import time

    path = os.path.join(directory, "socket")
    pid_file = os.path.join(directory, "pid")
    if not os.path.isdir(directory):
        return None
    deadline = time.monotonic() + FORK_SERVER_WAIT_S
    while not os.path.exists(path):
        try:
            server_pid = int(open(pid_file).read())  # noqa: SIM115
        except (OSError, ValueError):
            server_pid = 0
        if not server_pid or not alive(server_pid) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(FORK_SERVER_WAIT_S)  # (the first worker's answer waits for imports)
        conn.connect(path)
        body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        reader = conn.makefile("rb")
        answer = json.loads(reader.readline() or b"{}")
        pid = answer.get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(pid, int) or pid <= 0:
        return None  # refused: nothing was started

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    conn.settimeout(None)
    try:
        status = json.loads(reader.readline() or b"{}").get("exit")
    except (OSError, ValueError, AttributeError):
        status = None
    if isinstance(status, int):
        return status
    while alive(pid):  # the server went away without a word: the worker may live on
        time.sleep(0.5)
    return 1


def alive(pid: int) -> bool:
    """Whether the process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_as(status: int) -> None:
    """Exit as the worker did: with its code, or by the signal that ended it."""
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # (these have no handler to reset)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 1)


def main(argv: list[str]) -> None:
    raw, language, rest = parse(argv)
    try:
        context = json.loads(raw or "{}")
    except ValueError:
        context = None
    if (
        language != "PYTHON"
        or not isinstance(context, dict)
        or not set(context) <= KNOWN_FIELDS
        or not rest
    ):
        ray_own_setup_worker(argv)
        return
    for key, value in (context.get("env_vars") or {}).items():
        os.environ[key] = expand(value)
    if context.get("override_worker_entrypoint"):
        rest[0] = context["override_worker_entrypoint"]
    python = context.get("py_executable") or sys.executable
    prefix = context.get("command_prefix") or []
    server = os.environ.get(FORK_SERVER_ENV)
    if (
        server
        and not prefix
        and python == sys.executable
        and not context.get("override_worker_entrypoint")
    ):
        status = run_forked(server, [python, *rest])
        if status is not None:
            exit_as(status)
    if not prefix and is_program(python):
        os.execv(python, [python, *rest])
    # A prefix (conda's activation) or a command line as the Python (a container's, nsight's):
    # a shell runs it, as Ray's script does.
    command = [*prefix, "exec", python, *(shlex.quote(arg) for arg in rest)]
    os.execvp("bash", ["bash", "-c", " ".join(command)])


if __name__ == "__main__":
    main(sys.argv[1:])
