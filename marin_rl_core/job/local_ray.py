"""The driver's own Ray: a lean local head on loopback (no API server, autoscaler monitor or log
monitor) whose workers are forked from the job's fork server (:class:`LocalRay`), SIGTERM
handling, and quieting Ray's notices that do not apply."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (imported when used: `python -m` runs the root from this package)
    from marin_rl_core.job import fork_root

_UNSET: Any = object()

SETUP_WORKER = str(Path(__file__).with_name("ray_worker_start.py"))
"""The script the local Ray's raylet starts its workers with (see ``lean_loopback_head``)."""
AGENT_START = str(Path(__file__).with_name("ray_agent_start.py"))
"""The script its dashboard agent runs through (:mod:`marin_rl_core.job.ray_agent_start`)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and preemption send), handled like Ctrl-C: the trainer writes
    a checkpoint and the job ends with exit code 130."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def handle_sigterm() -> Any:
    """Turn SIGTERM into :class:`Terminated` in the main thread; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def lean_loopback_head() -> Iterator[None]:
    """Settings of Ray for the job's own local instance, for one ``ray.init`` (put back after).

    * Ray's single-machine mode (its default on macOS and Windows) puts the node on 127.0.0.1,
      so every server of this instance listens on loopback only; Ray reads the switch
      (``ray_constants.ENABLE_RAY_CLUSTER``) when it picks the node's address.
    * No HTTP API server, no autoscaler monitor and no log monitor: one node that never scales,
      no dashboard (``include_dashboard=False`` still starts the API server, for usage
      statistics only) and no job or state API clients need the first two, and the log monitor
      only copies workers' output to drivers that ask for it (``log_to_driver``), which the
      job's driver does not (each worker logs to ``run_dir/logs``). ``ray.init`` waits for the
      first two one after the other, and the log monitor's start competes for the CPU with the
      raylet's: together ~4 s of the job's start-up on a 2-core machine (issue 11). Ray has no
      public switch for them, so the three methods of Ray's ``Node`` that start them are
      skipped; where a Ray version lacks one, Ray starts that process as usual. The raylet's
      dashboard agent (which it needs) runs in Ray's minimal mode, as where the dashboard's
      packages are not installed: its other modules serve the dashboard and the state API, and
      checking for those packages imported them into the driver (0.2 s); the agent itself starts
      through :mod:`marin_rl_core.job.ray_agent_start`, which answers its own check the same
      way, so that it loads the modules a minimal Ray install's agent loads. Want the
      dashboard? Start a cluster with ``ray start --head --include-dashboard=true`` and pass
      ``--ray-address``.
    * The raylet starts each worker through :mod:`marin_rl_core.job.ray_worker_start`, which
      has the job's fork server (:mod:`marin_rl_core.job.worker_fork`, which the driver starts
      just before this ``ray.init``; its directory in the environment the driver gives the
      raylet) fork the worker with JAX, levanter and Ray imported, or does what Ray's own
      set-up script does, where Ray's script takes just the two options it reads. (The raylet
      leaves a script whose name ends in ``setup_worker.py`` out of the command of a worker
      without a runtime env, hence the name.)
    * Ray's processes (GCS, raylet, and the workers the raylet starts) run in a session of
      their own, as Ray already keeps SIGINT from them: a scheduler's SIGTERM to the job's
      whole process group (Slurm's ``scancel``, Kubernetes) reaches the driver alone, which
      stops the trainer with a final checkpoint and then shuts Ray down. They still die with
      the driver (Ray's fate sharing).
    """
    from ray._private import node, ray_constants, services, utils

    from marin_rl_core.job.ray_agent_start import no_dashboard

    # (owner, attribute, value while the job's ray.init runs); each is put back after.
    patches: list[tuple[Any, str, Any]] = [(ray_constants, "ENABLE_RAY_CLUSTER", False)]
    if (
        sys.platform != "win32"  # Ray's script runs the worker as a child there, not by exec
        and hasattr(ray_constants, "SETUP_WORKER_FILENAME")
        and _rays_setup_worker_is_known()
    ):
        # Ray joins the name to its workers' directory: an absolute path replaces it.
        patches.append((ray_constants, "SETUP_WORKER_FILENAME", SETUP_WORKER))
    if hasattr(utils, "get_dashboard_dependency_error"):
        patches.append((utils, "get_dashboard_dependency_error", no_dashboard))
        build = getattr(services, "_build_python_executable_command_memory_profileable", None)
        if build is not None and hasattr(ray_constants, "PROCESS_TYPE_DASHBOARD_AGENT"):
            agent = ray_constants.PROCESS_TYPE_DASHBOARD_AGENT
            patches.append(
                (services, build.__name__, functools.partial(_agent_command, build, agent))
            )
    patches += [
        (node.Node, name, _skip_head_process)
        for name in ("start_api_server", "start_monitor", "start_log_monitor")
        if name in node.Node.__dict__
    ]
    if sys.platform != "win32":
        own_session = functools.partial(services.ConsolePopen, start_new_session=True)
        patches.append((services, "ConsolePopen", own_session))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _rays_setup_worker_is_known() -> bool:
    """Whether Ray's own set-up script takes the two options ``ray_worker_start`` reads and no
    other (a Ray that adds one keeps its own script)."""
    import re

    from marin_rl_core.job.ray_worker_start import rays_own_script

    try:
        text = Path(rays_own_script()).read_text()
    except (OSError, ImportError):
        return False
    options = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", text)
    return sorted(options) == ["--language", "--serialized-runtime-env-context"]


def _skip_head_process(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _agent_command(build: Any, agent: str, component: str, *args: Any, **kwargs: Any) -> list[str]:
    """Ray's Python command for ``component``; the dashboard agent's goes through
    :mod:`marin_rl_core.job.ray_agent_start` (its modules as in a minimal Ray install)."""
    command = list(build(component, *args, **kwargs))
    return [*command, AGENT_START] if component == agent else command


def no_token_auth_notice(record: logging.LogRecord) -> bool:
    return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


class WorkerForkServer:
    """The fork server of one local Ray (:mod:`marin_rl_core.job.worker_fork`), started by its
    driver: :meth:`start` before ``ray.init`` (the raylet's environment names its directory,
    ``MARINRL_WORKER_FORK``, and the workers' environment is the driver's), :meth:`stop` after
    ``ray.shutdown``. It is forked from the process's root (:class:`fork_root.ForkRoot`), started
    anew for the first job and where the environment changed since (the new root imports while
    Ray starts)."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self._root: fork_root.ForkRoot | None = None

    def start(self, owner: int | None = None) -> None:
        """Make the server's directory and have a root fork the server for it, in this
        process's environment; it exits when the process ``owner`` (this one by default)
        does."""
        import tempfile

        from marin_rl_core.job import fork_root, worker_fork

        owner = owner or os.getpid()
        self.directory = tempfile.mkdtemp(prefix="marinrl-fork-")  # only this user enters it
        os.environ[worker_fork.ENV] = self.directory
        self._root = fork_root.serve_job(self.directory, owner)

    def server_pid(self) -> int | None:
        """The pid of the job's server (``None``: not forked yet, or no directory)."""
        try:
            pid = int(open(os.path.join(self.directory or "", "pid")).read())  # noqa: SIM115
        except (OSError, ValueError):
            return None
        return None if self._root is not None and pid == self._root.process.pid else pid

    def stop(self) -> None:
        import shutil
        import time

        from marin_rl_core.job import worker_fork
        from marin_rl_core.job.ray_worker_start import alive

        os.environ.pop(worker_fork.ENV, None)
        if not self.directory:
            return
        pid = self.server_pid()
        if pid is None and self._root is not None:  # the root has not forked it yet: no use
            self._root.close()  # (SIGTERM while it imports: it exits at once)
            deadline = time.monotonic() + 5
            while self._root.process.poll() is None and time.monotonic() < deadline:
                pid = self.server_pid()  # (forked meanwhile: the root waits for it)
                if pid is not None:
                    break
                time.sleep(0.01)
            if self._root.process.poll() is not None:  # (killed while importing)
                shutil.rmtree(self._root.directory, ignore_errors=True)
        if pid is not None:

            def gone(seconds: float = 5.0) -> bool:
                deadline = time.monotonic() + seconds
                while alive(pid) and time.monotonic() < deadline:  # (its root reaps it)
                    time.sleep(0.01)
                return not alive(pid)

            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            if not gone():
                worker_fork._kill(pid)
                gone()
        try:  # why a worker was not forked, or the server did not serve: in the driver's log
            said = open(os.path.join(self.directory, "server.log")).read().strip()  # noqa: SIM115
        except OSError:
            said = ""
        if said:
            logging.getLogger(worker_fork.__name__).info(
                "the fork server of the local Ray: %s", said[-2000:]
            )
        self._root = None
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None


class LocalRay:
    """The job's own Ray on this machine: :meth:`start` starts the fork server
    (:class:`WorkerForkServer`, POSIX) and then a new local instance with
    :func:`lean_loopback_head`, token authentication on and the workers at this process's
    niceness; :meth:`stop` shuts both down and gives ``RAY_AUTH_MODE`` its earlier value back
    (Ray sets it in ``os.environ``: child processes started later would inherit Ray's)."""

    def __init__(self) -> None:
        self._auth_mode: Any = _UNSET
        self._fork_server: WorkerForkServer | None = None

    def start(self, num_cpus: int | None = None) -> str:
        """Start it (``num_cpus``: this machine's by default); returns its GCS address."""
        import ray

        # Ray turns token authentication on for a new local cluster and sets RAY_AUTH_MODE in
        # os.environ, with a warning addressed to Ray users: keep the authentication, drop the
        # warning.
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            no_token_auth_notice
        )
        if sys.platform != "win32":  # (fork; the raylet's workers start through it there)
            self._fork_server = WorkerForkServer()
            self._fork_server.start()
        try:
            self._init_ray(num_cpus)
        except BaseException:
            self.stop()  # (no fork server left behind a Ray that did not start)
            raise
        return ray.get_runtime_context().gcs_address

    def _init_ray(self, num_cpus: int | None) -> None:
        import ray

        with lean_loopback_head():
            # address="local": a new instance even where `ray start` left a cluster address
            # behind (plain ray.init() would try to join that one).
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=num_cpus or os.cpu_count() or 2,
                # Ray starts its workers at niceness 15, for clusters shared with services: the
                # job's trainer and samplers are the user's own work, at the user's priority.
                # Nor does the driver wait for the workers Ray would start ahead of the first
                # driver (its ray.init would wait without end for workers that cannot start):
                # the job's actors start theirs at once, forked from the fork server.
                _system_config={"worker_niceness": 0, "prestart_worker_first_driver": False},
            )

    def stop(self) -> None:
        import ray

        ray.shutdown()
        if self._fork_server is not None:
            self._fork_server.stop()
            self._fork_server = None
        if self._auth_mode is not _UNSET:
            if self._auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._auth_mode
            self._auth_mode = _UNSET
