"""The code sandbox's supervisor: runs untrusted programs with limits, one case at a time.

Run as a script by :mod:`marin_rl_plugins.code_sandbox` (``python -I -S sandbox_supervisor.py``),
never imported: it needs the standard library only and starts in ~10 ms. It reads one JSON
request on stdin and writes one JSON reply on stdout::

    {"cases": [{"files": {"program.py": "..."}, "argv": ["program.py"], "stdin": ""}, ...],
     "limits": {"cpu_s": 5, "wall_s": 10, "memory_mb": 512, "processes": 32,
                "file_mb": 16, "open_files": 64, "output_kb": 64},
     "python": "/path/to/python"}
    -> {"isolation": {...}, "results": [{"exit_code": 0, "signal": 0, "timed_out": false,
                                         "seconds": 0.03, "stdout": "...", "stderr": "..."}]}

Per case: a fresh temporary directory holding the case's files; a forked *keeper* (trusted) that
becomes a child subreaper and, where the kernel lets it, enters new mount, network and PID
namespaces (a user namespace first when not root): the file system read-only except the case's
directory, no network but a loopback that is down, and a PID namespace whose init (the keeper's
child) takes every process of the case with it when it exits. The program runs under rlimits
(CPU seconds, address space, file size, open files, no core files; process count via a ``pids``
cgroup when one can be made, else ``RLIMIT_NPROC`` where the kernel applies it), in a session of
its own, with a minimal environment. The keeper enforces the wall time (SIGKILL, no SIGTERM to
ignore) and kills whatever is left of the tree. What was enforced is reported in ``isolation``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import select
import shutil
import signal
import sys
import tempfile
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (generic syscall table)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SYNTAX_EXIT = 121  # the harness's exit code for a program that does not compile

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount_setattr(path: str, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")


def _isolate(workdir: str) -> dict:
    """Enter new namespaces (in the keeper, before it forks the case's init); return what held."""
    done = {"network": False, "pid_namespace": False, "read_only_fs": False}
    if platform.system() != "Linux":
        return done
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (0 if root else CLONE_NEWUSER)
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        # Some of them may be refused (a container's seccomp profile): take what is allowed.
        flags = CLONE_NEWNET | CLONE_NEWPID | (0 if root else CLONE_NEWUSER)
        if _libc.unshare(ctypes.c_int(flags)) != 0:
            return done
    done["network"] = True
    done["pid_namespace"] = True
    if flags & CLONE_NEWNS and platform.machine() in ("x86_64", "aarch64", "arm64"):
        try:
            _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount private")
            path = workdir.encode()
            _check(_libc.mount(path, path, None, MS_BIND | MS_REC, None), "bind workdir")
            _mount_setattr("/", MOUNT_ATTR_RDONLY, 0)
            _mount_setattr(workdir, 0, MOUNT_ATTR_RDONLY)
            done["read_only_fs"] = True
        except OSError:
            pass
    return done


def _pids_cgroup(limit: int) -> str | None:
    """A fresh ``pids`` cgroup holding at most ``limit`` processes, or None where none can be
    made (no controller, no permission)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/pids{path}")
        elif controllers == "":
            candidates.append(f"/sys/fs/cgroup{path}")
            candidates.append(f"/sys/fs/cgroup/unified{path}")
    for parent in candidates:
        group = os.path.join(parent, f"marinrl-sandbox-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(group)
        except OSError:
            continue
        try:
            with open(os.path.join(group, "pids.max"), "w") as f:
                f.write(str(limit))
            return group
        except OSError:
            _remove_cgroup(group)
    return None


def _remove_cgroup(group: str) -> None:
    for _ in range(50):
        try:
            os.rmdir(group)
            return
        except OSError:
            time.sleep(0.01)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _kill_descendants() -> None:
    """Kill every process left below this one (a subreaper: orphans become its children)."""
    for _ in range(100):
        children = _children(os.getpid())
        if not children:
            return
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            try:
                os.waitpid(child, 0)
            except ChildProcessError:
                pass


def _run_program(case: dict, limits: dict, python: str, workdir: str, group: str | None) -> None:
    """In the program's own process: limits, then exec. Never returns."""
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()
        os.chdir(workdir)
        stdin = os.open(os.path.join(workdir, ".stdin"), os.O_RDONLY)
        out = os.open(os.path.join(workdir, ".stdout"), os.O_WRONLY | os.O_CREAT, 0o600)
        err = os.open(os.path.join(workdir, ".stderr"), os.O_WRONLY | os.O_CREAT, 0o600)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        cpu = max(1, int(limits["cpu_s"]))
        megabyte = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * megabyte,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * megabyte,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if group is None and os.geteuid() != 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        os.execve(python, [python, "-I", *case["argv"]], env)
    except BaseException:  # noqa: BLE001 - the child must never return into the supervisor
        os._exit(125)
    os._exit(125)


def _user_processes() -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) of this real user."""
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def _wait(pid: int, timeout: float) -> int | None:
    """The status of child ``pid``, or None when it outlived ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if fd is not None:
            os.close(fd)


def _keeper(case: dict, limits: dict, python: str, workdir: str, report: int) -> None:
    """The forked keeper of one case (see the module docstring). Never returns."""
    try:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        group = _pids_cgroup(limits["processes"] + 2)  # + this keeper and the case's init
        if group is not None:  # before the file system turns read-only; the children inherit it
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        limits = dict(limits)
        if group is None and os.geteuid() != 0:
            limits["nproc"] = _user_processes() + limits["processes"]
        isolation = _isolate(workdir)
        isolation["process_limit"] = (
            "cgroup" if group else ("rlimit" if os.geteuid() != 0 else "none")
        )
        started = time.monotonic()
        init = os.fork()
        if init == 0:  # pid 1 of the case's PID namespace (where there is one)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            program = os.fork()
            if program == 0:
                _run_program(case, limits, python, workdir, group)
            while True:  # reap orphans until the program itself exits
                pid, status = os.wait()
                if pid == program:  # a signal's death as the shells write it: 128 + signal
                    code = os.waitstatus_to_exitcode(status)
                    os._exit(code if code >= 0 else 128 - code)
        status = _wait(init, limits["wall_s"])
        timed_out = status is None
        if timed_out:
            os.kill(init, signal.SIGKILL)
            status = os.waitpid(init, 0)[1]
        seconds = time.monotonic() - started
        _kill_descendants()
        code = os.waitstatus_to_exitcode(status)
        result = {
            "exit_code": code if code >= 0 else -1,
            "signal": -code if code < 0 else 0,
            "timed_out": timed_out,
            "seconds": seconds,
            "isolation": isolation,
            "cgroup": group,
        }
        os.write(report, json.dumps(result).encode())
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        try:
            os.write(report, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(1)


def _read(path: str, limit: int) -> tuple[str, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def run_case(case: dict, limits: dict, python: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="marinrl-sandbox-")
    try:
        for name, text in case.get("files", {}).items():
            path = os.path.join(workdir, name)
            if os.path.dirname(os.path.abspath(path)) != workdir:
                raise ValueError(f"a case's file names are plain names, not {name!r}")
            with open(path, "w") as f:
                f.write(text)
        with open(os.path.join(workdir, ".stdin"), "w") as f:
            f.write(case.get("stdin") or "")
        read_end, write_end = os.pipe()
        keeper = os.fork()
        if keeper == 0:
            os.close(read_end)
            _keeper(case, limits, python, workdir, write_end)
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        os.close(read_end)
        os.waitpid(keeper, 0)
        result = json.loads(b"".join(chunks) or b'{"error": "the keeper died"}')
        if result.get("cgroup"):  # empty now: its last process, the keeper, has exited
            _remove_cgroup(result.pop("cgroup"))
        if "error" in result:
            raise RuntimeError(result["error"])
        limit = limits["output_kb"] * 1024
        result["stdout"], result["stdout_truncated"] = _read(f"{workdir}/.stdout", limit)
        result["stderr"], _ = _read(f"{workdir}/.stderr", limit)
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    request = json.loads(sys.stdin.read())
    results: list[dict] = []
    for case in request["cases"]:
        last = results[-1] if results else {}
        out_of_time = last.get("timed_out") or last.get("exit_code") == 128 + signal.SIGXCPU
        if request.get("stop_after_timeout") and out_of_time:
            results.append({"skipped": True, "timed_out": True})
            continue
        results.append(run_case(case, request["limits"], request["python"]))
    sys.stdout.write(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
