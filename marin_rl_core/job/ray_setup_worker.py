"""What the raylet of a job's own local Ray runs to start each worker, in place of Ray's
``ray/_private/workers/setup_worker.py``: the same steps without importing Ray.

The raylet starts every worker as ``python <setup worker> --serialized-runtime-env-context=<json>
--language=PYTHON <default_worker.py> <its arguments>``. Ray's own set-up script imports Ray's
logging, runtime-env and protobuf modules (~0.5 CPU-s on a 2-core machine) only to read that
JSON, put its ``env_vars`` into the environment and ``exec`` the worker's Python; the worker then
imports Ray again. A job starts four to six workers (trainer, rollout workers, hub, rollout
queue, the ones Ray starts ahead), so this script saves a few CPU-seconds of every job's start.

It is run as a script (``marin_rl_core`` is not imported) and does exactly what Ray's does for a
Python worker: ``env_vars`` expanded as Ray's ``update_envs`` does, then ``exec`` of
``command_prefix`` + ``py_executable`` + the worker's arguments (straight where the Python is a
program's path and there is no prefix, through ``bash -c`` otherwise, as Ray does), with
``override_worker_entrypoint`` in place of the worker's script. Anything else (another language, a context with fields this script does not know) is handed to
Ray's own script unchanged. :func:`marin_rl_core.job.local_ray.lean_loopback_head` installs it
where Ray's own script takes these two options and no other (a later Ray's keeps its own).
"""

from __future__ import annotations

import json
import os
import re
import shlex
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
    if not prefix and is_program(python):
        os.execv(python, [python, *rest])
    # A prefix (conda's activation) or a command line as the Python (a container's, nsight's):
    # a shell runs it, as Ray's script does.
    command = [*prefix, "exec", python, *(shlex.quote(arg) for arg in rest)]
    os.execvp("bash", ["bash", "-c", " ".join(command)])


if __name__ == "__main__":
    main(sys.argv[1:])
