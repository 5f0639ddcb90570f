"""The root of a process's fork servers (:mod:`marin_rl_core.job.worker_fork`): a process
that imports what every job process imports before Ray (:data:`EARLY`: JAX, transformers, ...)
once, and forks each job's server with those imported.

A process's first job starts a root (:class:`ForkRoot`; its driver just before ``ray.init``, so
that the root imports while Ray's processes start), and the root forks that job's server as
soon as it has imported. The root stays for the process's later jobs (a notebook's, the test
suite's): each asks it (:meth:`ForkRoot.fork`) for a server of its own, forked with
:data:`EARLY` imported, where the job's environment and directory are the root's (~2 CPU-s and
~1.5 s of a tiny job spared on a 2-core machine). A job in another environment (a variable
those imports could read set since: :func:`~marin_rl_core.job.worker_fork.differences`) starts
a root of its own; the old one takes no more jobs and exits once its jobs' servers have. The
processes a driver starts find its root in their environment
(:data:`~marin_rl_core.job.worker_fork.ROOT_ENV`): their jobs (``marinrl run`` from a notebook,
the test suite's subprocess jobs) ask it first, on the same terms. A root exits with its
driver, or after :data:`ROOT_IDLE_S` without a job; each job's server goes when its own driver
stops the job's Ray, or dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import sys
import threading
import time

from marin_rl_core.job.forking import Wakeup, exit_when_done
from marin_rl_core.job.ray_worker_start import alive
from marin_rl_core.job.worker_fork import (
    ROOT_ENV,
    _kill,
    _read_line,
    _send_message,
    differences,
    serve,
)

EARLY = (
    "numpy",
    "jax",
    "jax.numpy",
    "equinox",
    "optax",
    "haliax",
    "transformers",
    "huggingface_hub",
    "pyarrow",
    "tensorstore",
)
"""What the server imports as soon as it starts, while Ray starts beside it: most of what
:data:`PRELOAD` imports (~1.4 of its ~1.7 s), none of it Ray."""


def import_early() -> tuple[dict[str, str], dict[str, str]]:
    """Import :data:`EARLY` (as every job process does, with marinrl's deferred imports on);
    returns the environment before the imports and what they set in it."""
    own_env = dict(os.environ)  # what a worker's environment is compared with: before imports
    from marin_rl_core import deferred_imports

    deferred_imports.defer()  # as every job process does, before levanter is imported
    import importlib

    preload = os.environ.get("MARINRL_FORK_PRELOAD")  # (tests: a server that imports little)
    for name in () if preload else EARLY:
        importlib.import_module(name)
    if not preload:
        # pyarrow imports pandas (past its deferral) at a process's first ``pa.array``, and
        # every job process makes one (weights and rollouts travel as Arrow): made here once,
        # it spares each forked worker that import (0.37 CPU-s alone, 0.7-1.1 s of a trainer's
        # and a rollout worker's start beside each other on a 2-core machine).
        import pyarrow

        pyarrow.array([0])
    if "ray._raylet" in sys.modules:
        raise SystemExit("Ray was imported before the raylet's environment was known: not forking")
    # What the imports set (TF_CPP_MIN_LOG_LEVEL, TRANSFORMERS_VERBOSITY, ...): a worker that
    # imported them itself would have them too.
    return own_env, {k: v for k, v in os.environ.items() if own_env.get(k) != v}


ROOT_IDLE_S = 300.0
"""How long a root (:func:`serve_jobs`) stays with no job's server alive before it exits."""


def serve_jobs(root: str, owner: int, first: str, idle_s: float = ROOT_IDLE_S) -> None:
    """The root server of the process ``owner`` (a driver, which may run one job after another:
    a notebook, the test suite): import :data:`EARLY` once, fork the server of the job whose
    directory is ``first`` (:func:`serve`), then one for each later job that asks at
    ``root``'s socket in the same environment and directory (anything else is refused: its
    driver starts a root of its own). Exits when ``owner`` does, after ``idle_s`` without a
    job's server alive, or on SIGTERM once the servers it forked have exited (it takes no new
    job after SIGTERM; the ones it has go on, and it reaps their servers)."""
    own_env, imported_env = import_early()
    cwd = os.getcwd()
    jobs: set[int] = set()  # the pids of the jobs' servers it forked
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    selector = selectors.DefaultSelector()

    def fork_job(directory: str, conn: socket.socket | None = None, job_owner: int = owner) -> int:
        """Fork ``directory``'s server for the driver ``job_owner`` (``conn``: the connection
        that asked for it); its pid (written to the directory's ``pid`` file, where the job's
        workers look for it)."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = wake.fork()  # (SIGTERM held until the server's wake.close())
        if pid == 0:

            def become_the_jobs_server() -> None:
                wake.close()
                if conn is not None:
                    conn.close()
                selector.close()
                listener.close()
                log = os.open(
                    os.path.join(directory, "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
                )
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                serve(directory, job_owner, own_env, imported_env)

            exit_when_done(become_the_jobs_server)  # (its errors in the job's server.log)
        jobs.add(pid)
        pid_file = os.path.join(directory, "pid")
        try:
            with open(pid_file + ".tmp", "w") as out:
                out.write(str(pid))
            os.replace(pid_file + ".tmp", pid_file)
        except OSError:  # the job is gone already (its driver removed the directory)
            _kill(pid)
        return pid

    def answer(conn: socket.socket) -> None:
        conn.settimeout(10.0)
        try:
            request = json.loads(_read_line(conn))
            directory, env = request["directory"], request["env"]
            job_owner = int(request["owner"])
            differ = differences(env, own_env, imported_env)
            refused = (
                f"the job's environment differs in {differ}"
                if differ
                else f"the job's Python is {request['python']}, the root's {sys.executable}"
                if request["python"] != sys.executable
                else f"the job's directory is {request['cwd']}, the root's {cwd}"
                if request["cwd"] != cwd
                else f"no directory {directory}"
                if not os.path.isdir(directory)
                else ""
            )
            reply = (
                {"refused": refused} if refused else {"pid": fork_job(directory, conn, job_owner)}
            )
            _send_message(conn, reply)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        finally:
            conn.close()

    listener.bind(os.path.join(root, "socket.tmp"))
    listener.listen(16)
    selector.register(listener, selectors.EVENT_READ, "accept")
    wake = Wakeup(selector)
    fork_job(first)
    # The socket appears once the first job's server is forked: later jobs ask here.
    os.replace(os.path.join(root, "socket.tmp"), os.path.join(root, "socket"))
    idle_since = None
    try:
        while alive(owner):
            if wake.stopped and listener.fileno() >= 0:  # no more jobs; the ones it has go on
                selector.unregister(listener)
                listener.close()
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(root, "socket"))
            if wake.stopped and not jobs:
                break
            for key, _ in selector.select(timeout=1.0):
                if key.data == "accept":
                    answer(listener.accept()[0])
                else:
                    wake.drain()
            while jobs:  # the jobs' servers that exited (each reaps its own workers)
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    jobs.clear()
                    break
                if pid == 0:
                    break
                jobs.discard(pid)
            if jobs:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_s:
                break
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


class ForkRoot:
    """The root of this process's jobs' fork servers (:func:`serve_jobs`), seen from the
    driver: started with a job's directory, whose server it forks once it has imported
    :data:`EARLY`; later jobs of the process (and of processes it starts) in the same
    environment ask it for theirs (:meth:`fork`) and are spared those imports."""

    def __init__(self, owner: int, first: str) -> None:
        import subprocess
        import tempfile
        import threading

        self.owner = owner
        self.directory = tempfile.mkdtemp(prefix="marinrl-forkroot-")  # only this user enters
        with open(os.path.join(self.directory, "root.log"), "ab") as log:
            # A session of its own: a signal to the driver's process group is the driver's.
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    self.directory,
                    str(owner),
                    first,
                    str(ROOT_IDLE_S),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        # Reaped as soon as it exits (a zombie would look alive to the workers waiting for it).
        threading.Thread(target=self.process.wait, name="fork-root-reaper", daemon=True).start()
        os.environ[ROOT_ENV] = self.directory  # (the jobs of processes this one starts ask too)

    def fork(self, directory: str) -> tuple[int | None, str]:
        """Ask for the server of the job in ``directory`` (:func:`ask`)."""
        if self.process.poll() is not None:  # (killed: nobody else removes its directory)
            import shutil

            shutil.rmtree(self.directory, ignore_errors=True)
            return None, f"the root exited with status {self.process.returncode}"
        return ask(self.directory, directory, self.owner)

    def close(self) -> None:
        """It takes no more jobs, and exits once the servers it forked have."""
        with ROOTS_LOCK:
            if ROOTS.get(self.owner) is self:
                del ROOTS[self.owner]
        if os.environ.get(ROOT_ENV) == self.directory:
            del os.environ[ROOT_ENV]
        if self.process.poll() is None:
            self.process.terminate()


def ask(root: str, directory: str, owner: int) -> tuple[int | None, str]:
    """Ask the root at ``root`` for the server of the job in ``directory``, whose driver is the
    process ``owner``: ``(its pid, "")``, or ``(None, why not)`` (another environment, Python or
    directory than the root's, the root gone or still importing)."""
    import json

    path = os.path.join(root, "socket")
    if not os.path.exists(path):
        return None, f"no root serving at {root} (gone, or still importing)"
    request = {
        "directory": directory,
        "owner": owner,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "python": sys.executable,
    }
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10.0)
            conn.connect(path)
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = json.loads(_read_line(conn) or b"{}")
    except (OSError, ValueError) as exc:
        return None, f"asking the root failed ({exc})"
    pid = answer.get("pid")
    if isinstance(pid, int) and pid > 0:
        return pid, ""
    return None, str(answer.get("refused") or "the root did not answer")


ROOTS: dict[int, ForkRoot] = {}  # owner pid -> its root (one environment at a time)
ROOTS_LOCK = threading.RLock()


def close_roots() -> None:
    for root in list(ROOTS.values()):
        root.close()


def serve_job(directory: str, owner: int) -> ForkRoot | None:
    """Have the job in ``directory``, whose driver is the process ``owner``, a server: forked
    from ``owner``'s root where that root serves this environment, else from the root of the
    process that started this one (:data:`ROOT_ENV`) on the same terms, else from a new root of
    ``owner``'s, which it returns (``None``: another process's root serves the job; the
    directory's ``pid`` file names the server, or the new root until it has forked it)."""
    import atexit
    import logging

    with ROOTS_LOCK:  # (one root an owner, where its jobs start from several threads)
        root = ROOTS.get(owner)
        pid, why = root.fork(directory) if root else (None, "")
        inherited = os.environ.get(ROOT_ENV)
        if pid is None and root is None and inherited:
            pid, why = ask(inherited, directory, owner)
        if pid is not None:
            return root
        if why:
            logging.getLogger(__name__).info("a new root fork server for this job: %s", why)
        if root is not None:
            root.close()
        if not ROOTS:
            atexit.unregister(close_roots)  # (once)
            atexit.register(close_roots)
        root = ROOTS[owner] = ForkRoot(owner, directory)
        # The workers wait while the root lives, until it has forked the job's server (which then
        # names itself here): written unless the root was first.
        pid_file = os.path.join(directory, "pid")
        with open(pid_file + ".root", "w") as out:
            out.write(str(root.process.pid))
        with contextlib.suppress(FileExistsError):
            os.link(pid_file + ".root", pid_file)
        os.unlink(pid_file + ".root")
        return root


if __name__ == "__main__":
    try:
        serve_jobs(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Nothing is left to clean up: without the interpreter's teardown of what it imported
    # (~0.6 s on a 2-core machine, ~2 s while the job's Ray shuts down beside it).
    os._exit(0)
