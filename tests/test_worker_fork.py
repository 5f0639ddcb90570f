"""The local Ray's fork server: a worker forked from it gets what an ``exec``'d worker gets
(arguments, environment, directory, standard streams, exit status), signals reach it, and
nothing it started outlives it; where the server cannot serve a worker (another environment,
no server), the worker is ``exec``'d as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marin_rl_core.job import fork_root
from marin_rl_core.job.local_ray import SETUP_WORKER, WorkerForkServer
from marin_rl_core.job.worker_fork import ENV

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork and Unix sockets")

WORKER = """
import json, os, sys, time
out = os.environ["MARINRL_T_OUT"]
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("MARINRL_T_VAR"),
           "forked": os.environ.get("MARINRL_FORKED_FROM"), "pid": os.getpid(),
           "json_loaded": "json" in sys.modules}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(7)
if mode == "child":  # starts a process of its own, then waits
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(out + ".child", "w").write(str(child.pid))
if mode in ("child", "wait"):
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(15 + 100))
    time.sleep(120)
"""


def workers_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: str) -> None:
    """This process's environment as the workers' (the driver starts the server in the
    environment it starts Ray in); the server imports ``preload`` (``MARINRL_FORK_PRELOAD``),
    not the job's modules."""
    monkeypatch.setenv("MARINRL_FORK_PRELOAD", preload)
    monkeypatch.setenv("MARINRL_T_OUT", str(tmp_path / "out.json"))
    monkeypatch.setenv("MARINRL_T_VAR", "x")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # (a ray.init in this process sets it)


@pytest.fixture(autouse=True)
def own_roots(monkeypatch: pytest.MonkeyPatch):
    """The roots this test's servers are forked from are its own (not those of the jobs other
    tests run in this process), and gone after it."""
    roots: dict = {}
    monkeypatch.setattr(fork_root, "ROOTS", roots)
    started: list = []
    real_init = fork_root.ForkRoot.__init__

    def init(self, *args):
        real_init(self, *args)
        started.append(self)

    monkeypatch.setattr(fork_root.ForkRoot, "__init__", init)
    yield started
    for root in started:
        root.close()
        root.process.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fork server started as the driver starts one before ``ray.init``; this process
    stands in for the driver, the set-up scripts it starts for the raylet's."""
    workers_environment(tmp_path, monkeypatch, "json")
    forks = WorkerForkServer()
    forks.start()
    yield forks
    started = time.monotonic()
    forks.stop()
    assert time.monotonic() - started < 3, "the server took long to go"
    assert not os.path.exists(forks.directory or "/nonexistent")


def wait_until_forked(forks: WorkerForkServer) -> int | None:
    """The job's server pid, once its root has imported and forked it (30 s at most)."""
    deadline = time.monotonic() + 30
    while forks.server_pid() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return forks.server_pid()


def a_job_and_its_end() -> None:
    """A job's fork server started (its root with it, the first time) and stopped, once the
    root has forked it."""
    forks = WorkerForkServer()
    forks.start()
    wait_until_forked(forks)
    forks.stop()


def start(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The worker script through the set-up script, as the raylet starts it."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen(
        [sys.executable, SETUP_WORKER, "--language=PYTHON", str(script), mode],
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reported(tmp_path: Path, timeout: float = 60.0) -> dict:
    out = tmp_path / "out.json"
    deadline = time.monotonic() + timeout
    while not out.exists():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return json.loads(out.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not alive either.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_worker_gets_its_arguments_directory_streams_and_exit_status(server, tmp_path):
    proc = start(tmp_path, "exit")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert out == "to stdout\n" and err == "to stderr\n"
    got = reported(tmp_path)
    assert got["argv"] == [str(tmp_path / "worker.py"), "exit"]
    assert got["cwd"] == str(tmp_path) and got["var"] == "x"
    assert got["forked"] and got["json_loaded"] and got["pid"] != proc.pid


def test_sigterm_to_the_started_process_reaches_the_worker(server, tmp_path):
    proc = start(tmp_path, "wait")
    reported(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 115, "the worker's own SIGTERM handler ran and its status came back"


def test_a_worker_killed_ends_its_started_process_as_killed(server, tmp_path):
    proc = start(tmp_path, "wait")
    worker = reported(tmp_path)["pid"]
    os.kill(worker, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_a_started_process_killed_takes_its_worker_and_what_the_worker_started(server, tmp_path):
    """The raylet kills the process it started (and its process group): the forked worker
    and the processes it started go too, as they would with an exec'd worker."""
    proc = start(tmp_path, "child")
    worker = reported(tmp_path)["pid"]
    child_file = tmp_path / "out.json.child"
    deadline = time.monotonic() + 30
    while not child_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(child_file.read_text())
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while (alive(worker) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker) and not alive(child)


def test_a_worker_in_another_environment_is_execd_as_without_a_server(server, tmp_path):
    """A variable the server's imports could read differs from the environment the server
    started in, as a runtime env's ``env_vars`` would: not forked; the worker runs all the
    same."""
    first = start(tmp_path, "exit")
    first.communicate(timeout=60)
    assert reported(tmp_path)["forked"]
    (tmp_path / "out.json").unlink()
    proc = start(tmp_path, "exit", {"MARINRL_T_VAR": "y", "JAX_PLATFORMS": "cpu,other"})
    proc.communicate(timeout=60)
    assert proc.returncode == 7
    got = reported(tmp_path)
    assert got["forked"] is None and got["pid"] == proc.pid and got["var"] == "y"
    log = (Path(server.directory) / "server.log").read_text()
    assert (
        "not forked: the worker's environment differs in ['JAX_PLATFORMS', 'MARINRL_T_VAR']" in log
    )


def test_a_forked_worker_dying_at_start_stops_the_forking(server, tmp_path):
    """A worker that exits with an error before it reaches Ray's worker loop (as a Ray worker
    would that cannot start forked; this one never does) stops the forking: the raylet would
    start it again without end; the workers after it are exec'd, and the log says why."""
    first = start(tmp_path, "exit")  # exits with status 7 at once
    first.communicate(timeout=60)
    assert first.returncode == 7 and reported(tmp_path)["forked"]
    log = Path(server.directory) / "server.log"
    deadline = time.monotonic() + 10
    while "not forking any more" not in log.read_text():
        assert time.monotonic() < deadline, "the server did not stop forking"
        time.sleep(0.05)
    (tmp_path / "out.json").unlink()
    proc = start(tmp_path, "exit")
    proc.communicate(timeout=60)
    got = reported(tmp_path)
    assert proc.returncode == 7 and got["forked"] is None and got["pid"] == proc.pid
    said = log.read_text()
    assert "a forked worker exited with status 7 before it reached Ray's worker loop" in said
    assert "not forked: forking stopped" in said


def test_without_a_server_the_worker_is_execd(tmp_path, monkeypatch):
    """A directory with a dead server in it (its pid recorded, no socket): exec'd at once."""
    directory = tmp_path / "forks"
    directory.mkdir()
    (directory / "pid").write_text(str(2**22 + 12345))  # no such process
    workers_environment(tmp_path, monkeypatch, "json")
    monkeypatch.setenv(ENV, str(directory))
    started = time.monotonic()
    proc = start(tmp_path, "exit")
    proc.communicate(timeout=60)
    assert proc.returncode == 7 and reported(tmp_path)["forked"] is None
    assert time.monotonic() - started < 20, "it did not wait for a server that is gone"


def test_the_server_goes_with_its_driver(tmp_path, monkeypatch):
    """The driver gone (here a process standing in for it, killed), the job's server exits and
    removes its directory, and the root it was forked from goes too."""
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    workers_environment(tmp_path, monkeypatch, "json")
    forks = WorkerForkServer()
    forks.start(owner=driver.pid)
    directory = Path(forks.directory)
    try:
        proc = start(tmp_path, "exit")
        proc.communicate(timeout=60)
        assert proc.returncode == 7 and reported(tmp_path)["forked"]
        server = int((directory / "pid").read_text())
        root = forks._root
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 15
        while (alive(server) or directory.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server) and not directory.exists()
        assert root.process.wait(timeout=15) == 0 and not os.path.exists(root.directory)
    finally:
        forks.stop()


RAY_WORKER = """
import json, os
import ray._raylet
out = os.environ["MARINRL_T_OUT"]
json.dump({"forked": os.environ.get("MARINRL_FORKED_FROM"),
           "mode": str(ray._raylet.get_authentication_mode())}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
"""


def test_ray_is_imported_with_what_the_raylet_gives_its_workers(tmp_path, monkeypatch):
    """Ray's C++ settings are read from the environment when Ray is imported (the raylet's
    pid, the job, the authentication mode that ``ray.init`` turns on after the server has
    started): the server imports Ray in the first worker's environment, and a forked worker's
    Ray has the authentication mode that environment names, as an exec'd one has."""
    workers_environment(tmp_path, monkeypatch, "ray._raylet")
    forks = WorkerForkServer()
    forks.start()  # (no RAY_AUTH_MODE in its environment)
    script = tmp_path / "ray_worker.py"
    script.write_text(RAY_WORKER)

    def run(*command: str, auth: str) -> dict:
        env = {**os.environ, "RAY_AUTH_MODE": auth}
        assert subprocess.run([sys.executable, *command], env=env, timeout=120).returncode == 0
        got = reported(tmp_path)
        (tmp_path / "out.json").unlink()
        return got

    try:
        forked = run(SETUP_WORKER, "--language=PYTHON", str(script), auth="token")
    finally:
        forks.stop()
    execd = {auth: run(str(script), auth=auth) for auth in ("token", "disabled")}
    assert forked["forked"] and execd["token"]["forked"] is None
    assert forked["mode"] == execd["token"]["mode"] != execd["disabled"]["mode"]


def test_a_local_ray_that_fails_to_start_leaves_no_fork_server(tmp_path, monkeypatch):
    """``ray.init`` failing (here made to): the job's fork server started before it is
    stopped, its directory removed and ``MARINRL_WORKER_FORK`` unset, before the error reaches
    the caller."""
    from marin_rl_core.job.local_ray import LocalRay

    workers_environment(tmp_path, monkeypatch, "json")

    def fails(self, num_cpus):
        raise RuntimeError("ray.init failed")

    monkeypatch.setattr(LocalRay, "_init_ray", fails)
    local = LocalRay()
    started = []
    real_start = WorkerForkServer.start

    def start(self, owner=None):
        real_start(self, owner)
        started.append((self.directory, wait_until_forked(self)))

    monkeypatch.setattr(WorkerForkServer, "start", start)
    with pytest.raises(RuntimeError, match="ray.init failed"):
        local.start(1)
    ((directory, pid),) = started
    assert pid and not alive(pid), "the job's fork server still runs"
    assert not os.path.exists(directory) and ENV not in os.environ


def test_a_job_stopped_the_moment_its_server_is_forked_ends_it_with_sigterm(monkeypatch):
    """A job that stops right after its root forked its server (a Ray that failed to start, a
    Ctrl-C at the start): the server's SIGTERM is not lost in the moment before the server has
    its own handler, so the stop needs no SIGKILL (a lost one waited 5 s, then killed it; 15 of
    20 such stops did before the fix)."""
    from marin_rl_core.job import worker_fork

    killed: list[int] = []
    real_kill = worker_fork._kill

    def kill(pid):
        killed.append(pid)
        real_kill(pid)

    monkeypatch.setattr(worker_fork, "_kill", kill)
    for _ in range(8):
        forks = WorkerForkServer()
        forks.start()
        deadline = time.monotonic() + 30
        while forks.server_pid() is None and time.monotonic() < deadline:
            pass  # no sleep: the SIGTERM goes as soon as the server's pid is there
        pid = forks.server_pid()
        forks.stop()
        assert pid and not alive(pid), "the job's fork server still runs"
    assert not killed, f"servers that ignored their SIGTERM and were killed: {killed}"


def server_parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_later_jobs_servers_are_forked_from_one_root_while_the_environment_stays(
    tmp_path, monkeypatch, own_roots
):
    """A process's jobs one after another (a notebook, the test suite): the second job's server
    is forked from the root that imported for the first (no imports again), and serves its
    workers as the first did. A job in another environment gets a root of its own; the old
    root, with no job left, exits."""

    def job(expected_var: str) -> tuple[WorkerForkServer, int]:
        forks = WorkerForkServer()
        forks.start()
        try:
            proc = start(tmp_path, "exit")
            proc.communicate(timeout=60)
            got = reported(tmp_path)
            (tmp_path / "out.json").unlink()
            assert proc.returncode == 7 and got["var"] == expected_var
            pid = forks.server_pid()
            assert got["forked"] == str(pid), "not forked from the job's server"
            return forks, server_parent(pid)
        finally:
            forks.stop()

    workers_environment(tmp_path, monkeypatch, "json")
    first, first_parent = job("x")
    second, second_parent = job("x")
    (root,) = own_roots
    assert first_parent == second_parent == root.process.pid
    monkeypatch.setenv("MARINRL_T_VAR", "z")
    third, third_parent = job("z")
    assert len(own_roots) == 2 and third_parent == own_roots[1].process.pid
    assert root.process.wait(timeout=10) == 0 and not os.path.exists(root.directory)


def test_a_root_with_no_job_exits_after_a_while(tmp_path, monkeypatch, own_roots):
    workers_environment(tmp_path, monkeypatch, "json")
    monkeypatch.setattr(fork_root, "ROOT_IDLE_S", 0.5)
    a_job_and_its_end()
    (root,) = own_roots
    assert root.process.wait(timeout=15) == 0 and not os.path.exists(root.directory)


CHILD_JOB = """
import json, subprocess, sys
from marin_rl_core.job import fork_root
from marin_rl_core.job.local_ray import SETUP_WORKER, WorkerForkServer
forks = WorkerForkServer()
forks.start()
server = forks.server_pid()
worker = subprocess.run([sys.executable, SETUP_WORKER, "--language=PYTHON", sys.argv[1], "exit"])
forks.stop()
print(json.dumps({"server": server, "own_roots": len(fork_root.ROOTS),
                  "worker_status": worker.returncode}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_job_in_a_child_process_is_served_by_its_parents_root(tmp_path, monkeypatch, own_roots):
    """``marinrl run`` started by a process that ran a job (a notebook, the test suite): the
    child's job asks the parent's root for its server (``MARINRL_FORK_ROOT``), whose workers
    it forks as for the parent's own jobs; the child starts no root of its own."""
    workers_environment(tmp_path, monkeypatch, "json")
    a_job_and_its_end()
    (root,) = own_roots
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_JOB, str(script)], stdout=subprocess.PIPE, text=True
    )
    out, _ = child.communicate(timeout=120)
    got = json.loads(out.splitlines()[-1])
    assert child.returncode == 0 and got["own_roots"] == 0 and got["worker_status"] == 7
    assert reported(tmp_path)["forked"] == str(got["server"])
    assert not alive(got["server"]), "the child's job server outlived its job"


def test_a_job_after_its_root_was_killed_gets_a_new_one(tmp_path, monkeypatch, own_roots):
    """The root killed (SIGKILL, OOM) between two jobs: the next job starts a new root, whose
    server forks its workers, and the dead root's directory is removed."""
    workers_environment(tmp_path, monkeypatch, "json")
    a_job_and_its_end()
    (dead,) = own_roots
    dead.process.kill()
    dead.process.wait(timeout=10)
    second = WorkerForkServer()
    second.start()
    try:
        proc = start(tmp_path, "exit")
        proc.communicate(timeout=60)
        assert proc.returncode == 7 and reported(tmp_path)["forked"] == str(second.server_pid())
    finally:
        second.stop()
    assert len(own_roots) == 2 and not os.path.exists(dead.directory)
    said = (Path(own_roots[1].directory) / "root.log").read_text()
    assert said == "", said  # (nothing to say: no warning of a module imported twice either)
