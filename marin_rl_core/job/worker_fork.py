"""A fork server for the Ray workers of a job's own local Ray: the modules every job process
imports (JAX, levanter, Ray, marinrl's trainer and rollout worker) are imported once, in this
server, and each worker the raylet starts is forked from it instead of importing them again.

On a 2-core machine a trainer or rollout worker spends ~2.5 of its ~4-7 CPU-s importing, and
the job's hub and rollout queue ~1 s each importing Ray and marinrl's config: a job imports the
same modules four to six times (docs/development.md#tests).

The driver has the server started (:class:`~marin_rl_core.job.local_ray.WorkerForkServer`)
just before ``ray.init``, in the environment it starts Ray in: it is forked from the process's
root (:mod:`marin_rl_core.job.fork_root`), which imported JAX, transformers and the rest that
does not import Ray, once for the process's jobs. Ray and what imports it (:data:`PRELOAD`)
follow in the job's server, in the first worker's environment, which holds what Ray's C++ side
reads at import (the raylet's pid, the authentication mode, the job). A job's ``ray.init``
waits for the first workers Ray starts to register: on a 2-core machine ~2 s when the first
worker started the server and the server imported everything then.

How a worker starts (:mod:`marin_rl_core.job.ray_worker_start` is what the raylet runs):

1. The set-up script connects to this server's Unix socket (in ``MARINRL_WORKER_FORK``, a
   directory only this user can enter, which the driver made; waiting while the server
   imports what it imports first) and sends the worker's command line, environment and
   directory, with its standard input, output and error (``SCM_RIGHTS``).
2. The server forks; the child takes those, then runs Ray's ``default_worker.py`` as
   ``__main__`` with the modules already imported. The server answers the child's pid.
3. The set-up script stays the raylet's child for the worker's life, as the process the
   raylet started: it passes on SIGTERM, SIGINT and SIGHUP to the worker and exits with the
   worker's exit status, which the server reports when it reaps the child. Should the set-up
   script die (SIGKILL from the raylet), the server kills its worker.

Only where forking gives the worker what ``exec`` would give it: the same Python, no
command prefix or other entry point, and an environment that differs from the server's only
in what the raylet sets for its workers (:func:`differences`). Anything else, or a server not
there (dead, or not ready within a minute), and the set-up script ``exec``s the worker as
before. A job's server exits when the driver stops the local Ray, or within a second of the
driver's death (and then removes its directory itself).

The server imports, and has one Python thread when it forks (no Python lock can be held by a
thread the child does not have; checked: it refuses to serve otherwise; its native threads:
:func:`~marin_rl_core.job.forking.fork`). JAX's backends are not initialised in it: each worker makes its own. Nor is
Ray's C++ id generator seeded in it (:func:`_ray_random_untouched`, checked by
:func:`_forks_draw_their_own_ids`): each worker seeds its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

from marin_rl_core.job.forking import Wakeup, exit_when_done, fork
from marin_rl_core.job.ray_worker_start import alive

FORKED_FROM = "MARINRL_FORKED_FROM"
"""Set in a forked worker's environment: the server's pid (the worker's logs say so)."""

ENV = "MARINRL_WORKER_FORK"
"""The server's socket path, in the environment of the raylet (and so of the set-up script)."""

PRELOAD = (
    "ray",
    "ray.actor",
    "ray._private.worker",
    "marin_rl_core.job.actors",
    "marin_rl_core.learner.trainer",
    "marin_rl_core.rollout.worker",
    "marin_rl_core.rollout.manager",
)
"""What the server imports for the first worker, in its environment (Ray reads its C++ settings,
the raylet's pid among them, from the environment at import): what every worker of a job
imports before it does anything."""

_HEADER = struct.Struct("!I")
_MAX_REQUEST = 16 << 20


ROOT_ENV = "MARINRL_FORK_ROOT"
"""The directory of the root a driver started (:mod:`marin_rl_core.job.fork_root`), in its
environment: the jobs of processes it starts (``marinrl run`` from a notebook, the test
suite's) ask that root for their servers first."""

LATE_VARIABLES = frozenset(
    {ENV, ROOT_ENV, "SPT_NOENV", "PYTHONBREAKPOINT", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST"}
)
"""Variables read when used, after the imports: set by Ray (``SPT_NOENV`` at ``ray.init``, for
setproctitle's first call; ``PYTHONBREAKPOINT``, read by each ``breakpoint()``, in a driver's
environment from its first ``ray.init`` on), by marinrl, by a terminal library in the driver
(its size, read when output is laid out) or by pytest (the running test, set at each phase of a
test); like the ``RAY_`` ones the raylet sets for its workers, they may differ from the
server's."""


def differences(
    request_env: dict[str, str], own_env: dict[str, str], imported_env: dict[str, str]
) -> list[str]:
    """The variables by which a worker with ``request_env`` could import other modules, or the
    same modules otherwise, than the server did (JAX, transformers and marinrl read theirs at
    import; ``own_env`` is the server's environment before, ``imported_env`` what its imports
    set): every one but the ``RAY_`` ones and :data:`LATE_VARIABLES`, and where the imports set
    one that the worker does not have, the worker's would set it too."""
    keys = (set(request_env) | set(own_env)) - LATE_VARIABLES
    return sorted(
        key
        for key in keys
        if not key.startswith("RAY_")
        and request_env.get(key) != own_env.get(key)
        and not (key in imported_env and request_env.get(key) in (None, imported_env[key]))
    )


def _send_message(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _read_line(conn: socket.socket) -> bytes:
    """One line from ``conn`` (its timeout bounds each read), without the newline."""
    data = b""
    while not data.endswith(b"\n"):
        more = conn.recv(65536)
        if not more:
            break
        data += more
        if len(data) > _MAX_REQUEST:
            raise ValueError("request too long")
    return data.strip()


# --- the server ---------------------------------------------------------------------------------


def serve(
    directory: str, owner: int, own_env: dict[str, str], imported_env: dict[str, str]
) -> None:
    """One job's server, forked from the root (:func:`~marin_rl_core.job.fork_root.serve_jobs`)
    with what the root imports early imported in ``own_env`` (``imported_env``: what those
    imports set): listen at ``directory``'s socket, import :data:`PRELOAD` in the environment
    of the first worker, and fork a worker for each request until the process ``owner`` (the
    job's driver) exits or SIGTERM comes."""
    import importlib

    path = os.path.join(directory, "socket")
    preload = os.environ.get("MARINRL_FORK_PRELOAD")
    imported_env = dict(imported_env)
    imported = False

    def import_the_rest(first_env: dict[str, str]) -> None:
        """Ray and what imports it, in the first worker's environment (the raylet's pid, the
        authentication mode: Ray's C++ settings are read from it when Ray is imported)."""
        nonlocal imported
        if imported:
            return
        imported = True
        os.environ.clear()
        os.environ.update({**first_env, **imported_env})
        with _ray_random_untouched():
            for name in preload.split(",") if preload else PRELOAD:
                importlib.import_module(name)
        if not _forks_draw_their_own_ids():
            raise SystemExit("forked processes would draw the same Ray ids: not forking")
        if threading.active_count() != 1:
            raise SystemExit(f"{threading.active_count()} threads after the imports: not forking")
        imported_env.update({k: v for k, v in os.environ.items() if first_env.get(k) != v})

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.replace(path + ".tmp", path)  # the socket appears once the server takes requests
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    wake = Wakeup(selector)
    children: dict[int, socket.socket] = {}  # worker pid -> its set-up script's connection
    reached: dict[int, int] = {}  # worker pid -> a pipe it writes to once in Ray's worker loop
    stopped_forking = ""  # why the server forks no more workers
    try:
        while not wake.stopped and alive(owner):
            for key, _ in selector.select(timeout=1.0):
                if key.data == "accept":
                    conn, _ = listener.accept()
                    pid = _start(
                        conn,
                        own_env,
                        imported_env,
                        import_the_rest,
                        stopped_forking,
                        reached,
                        (listener, wake, selector, children, reached),
                    )
                    if pid:
                        children[pid] = conn
                        selector.register(conn, selectors.EVENT_READ, pid)
                    else:
                        conn.close()
                elif key.data == "wake":
                    wake.drain()
                else:  # a set-up script's connection: it died (nothing else is sent)
                    pid = key.data
                    selector.unregister(key.fileobj)
                    if pid in children:
                        _kill(pid)
            for pid, code in _reap(children, selector):
                # A forked worker that exits with an error before it reached Ray's worker loop
                # (it could not start: say a Ray that read its settings wrongly) would fail the
                # same way each time the raylet starts it again, without end (a job waiting on
                # its actors waiting with it): the workers after it are exec'd.
                in_the_loop = _reached_the_loop(reached.pop(pid, -1))  # (its pipe closed)
                if code > 0 and not in_the_loop and not stopped_forking:
                    stopped_forking = (
                        f"not forking any more: a forked worker exited with status {code} "
                        "before it reached Ray's worker loop; the workers after it are exec'd"
                    )
                    print(stopped_forking, file=sys.stderr, flush=True)
    finally:
        for pid in children:
            _kill(pid)
        if wake.stopped:  # the driver's stop: it removes the directory
            try:
                os.unlink(path)
            except OSError:
                pass
        else:  # the driver is gone (killed): nobody else will
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _start(
    conn: socket.socket,
    own_env: dict[str, str],
    imported_env: dict[str, str],
    before_fork: Any,
    stopped_forking: str,
    reached: dict[int, int],
    close_in_child: tuple,
) -> int | None:
    """Read one request and fork its worker; the worker's pid, or ``None`` (refused).
    ``before_fork(env)`` is called with the worker's environment before it is forked."""
    conn.settimeout(10.0)
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
        while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
            more = conn.recv(_MAX_REQUEST)
            if not more:
                raise OSError("short request")
            data += more
        request = json.loads(data[_HEADER.size :])
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        differ = differences(env, own_env, imported_env)
        refused = (
            "not forked: the request did not pass the three standard streams"
            if len(fds) != 3
            else f"not forked: another Python ({argv[0]})"
            if argv[0] != sys.executable or len(argv) < 2
            else f"not forked: the worker's environment differs in {differ}"
            if differ
            else "not forked: forking stopped (above)"
            if stopped_forking
            else ""
        )
        if refused:
            print(refused, file=sys.stderr)
            _send_message(conn, {"pid": 0})
            for fd in fds:
                os.close(fd)
            return None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    before_fork(env)
    sys.stdout.flush()
    sys.stderr.flush()
    loop_r, loop_w = os.pipe()
    pid = close_in_child[1].fork()  # (the server's Wakeup: SIGTERM held until the worker's)
    if pid == 0:  # the worker
        os.close(loop_r)
        exit_when_done(
            lambda: _become_worker(
                argv, {**env, **imported_env}, cwd, fds, conn, close_in_child, loop_w
            )
        )
    os.close(loop_w)
    os.set_blocking(loop_r, False)
    reached[pid] = loop_r
    for fd in fds:
        os.close(fd)
    try:
        _send_message(conn, {"pid": pid})
    except OSError:
        _kill(pid)
        os.close(reached.pop(pid))
        return None
    conn.settimeout(None)
    return pid


def _become_worker(argv, env, cwd, fds, conn, close_in_child, loop_w) -> None:  # noqa: ANN001
    """In the forked child: take the request's streams, directory and environment, then run
    Ray's worker script as ``__main__``."""
    listener, wake, selector, children, reached = close_in_child
    for fd in reached.values():
        os.close(fd)
    _say_when_in_the_worker_loop(loop_w)
    wake.close()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    selector.close()
    listener.close()
    for other in children.values():
        other.close()
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setpgid(0, 0)  # a group of its own, as the raylet gives each worker
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[FORKED_FROM] = str(os.getppid())
    sys.argv = list(argv[1:])
    import runpy

    runpy.run_path(argv[1], run_name="__main__")


def _say_when_in_the_worker_loop(loop_w: int) -> None:
    """Write to ``loop_w`` once Ray's worker loop starts (the worker registered and runs tasks);
    a Ray without that method: never (every error exit then counts as a failed start)."""
    worker = sys.modules.get("ray._private.worker")
    main_loop = getattr(getattr(worker, "Worker", None), "main_loop", None)
    if main_loop is None:
        return

    def main_loop_said(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            os.write(loop_w, b"1")
            os.close(loop_w)
        except OSError:
            pass
        return main_loop(self, *args, **kwargs)

    worker.Worker.main_loop = main_loop_said


def _reached_the_loop(loop_r: int) -> bool:
    if loop_r < 0:
        return False
    try:
        return os.read(loop_r, 1) == b"1"
    except OSError:
        return False
    finally:
        os.close(loop_r)


@contextlib.contextmanager
def _ray_random_untouched() -> Iterator[None]:
    """Ray's C++ random ids come from one generator per process, seeded at its first use: a
    process forked after that draws the same ids as every other one forked from it (two
    workers' object ids collided). What the imports define with ``@ray.remote`` (a class draws
    a random ``ActorClassID`` when it is defined: levanter defines some) takes its id from
    ``os.urandom`` here, so that the generator is first used, and seeded, in each worker."""
    import ray.actor

    real = ray.actor.ActorClassID

    class UrandomActorClassID:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def from_random(self) -> Any:
            return real(os.urandom(real.size()))

    ray.actor.ActorClassID = UrandomActorClassID()
    try:
        yield
    finally:
        ray.actor.ActorClassID = real


def _forks_draw_their_own_ids() -> bool:
    """Whether two processes forked from this one draw different random Ray ids (the check
    that nothing imported seeded Ray's generator here)."""
    from ray._raylet import ObjectID

    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = fork()
        if pid == 0:
            try:
                os.write(write, ObjectID.from_random().binary())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        drawn.append(os.read(read, 64))
        os.close(read)
    return drawn[0] != drawn[1]


def _kill(pid: int) -> None:
    """SIGKILL to the worker ``pid`` and its process group (what it started), as the raylet
    cleans up after each of its workers."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap(
    children: dict[int, socket.socket], selector: selectors.BaseSelector
) -> list[tuple[int, int]]:
    """Reap the workers that exited: ``[(pid, exit status), ...]`` (negative: by a signal)."""
    reaped: list[tuple[int, int]] = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is None:
            continue
        reaped.append((pid, os.waitstatus_to_exitcode(status)))
        try:  # what the worker started and left behind, as the raylet's clean-up does
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            _send_message(conn, {"exit": reaped[-1][1]})
        except OSError:
            pass
        conn.close()
    return reaped
