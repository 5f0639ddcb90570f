"""Errors a user can cause, and the exit codes the CLI maps them to.

Every error here carries a message that says what went wrong and what to do about it; most are
raised before any work starts, the rest (a dead worker, a stalled job, a full disk) stop a
running job, which keeps its last checkpoint. The CLI prints the message and exits with ``error.exit_code``.
This is a leaf module: it imports nothing from the rest of the core.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable
from typing import Any


class ExitCode(enum.IntEnum):
    """Process exit codes of the ``marinrl`` command (documented in ``docs/cli.md``)."""

    OK = 0
    FAILURE = 1
    """The job started and then failed (for example a NaN loss)."""
    USAGE = 2
    """A malformed command line (typer/click's own usage errors)."""
    CONFIG = 3
    """A config file or ``--set`` override has an unknown key, a wrong type or a bad value (or
    asks for a local job bigger than the machine's memory)."""
    UNKNOWN_PLUGIN = 4
    """A plugin name (``--env maht``) that no loaded plugin registers."""
    PLUGIN_IMPORT = 5
    """A plugin module failed to import."""
    DUPLICATE_PLUGIN = 6
    """Two plugins register the same name for one kind."""
    PLUGIN_CONTRACT = 7
    """A plugin breaks the hook contract (a hookimpl matching no hookspec, a malformed record)."""
    NOT_AVAILABLE = 8
    """The requested feature is not available in this version."""
    RESOURCES = 9
    """The Ray cluster does not have the resources the job asks for (``[resources]``)."""
    CLUSTER = 10
    """The Ray cluster of ``--ray-address`` cannot be reached or joined."""
    RUN_DIR = 11
    """The run directory cannot be written (read-only, full disk, a file in the way) or read
    (a damaged ``config.toml``, ``state.json`` or metrics file)."""
    STALLED = 12
    """The watchdog stopped a job in which no training step completed for too long."""
    WORKER_LOST = 13
    """A worker process died more often than it may be restarted."""
    STORAGE = 14
    """Rollout storage (a bucket, a path) did not answer within its timeouts and retries."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C or SIGTERM; a resumable checkpoint was written."""


class MarinRLError(Exception):
    """Base class of the errors a user can cause; ``str(err)`` is the full user-facing message."""

    exit_code: ExitCode = ExitCode.FAILURE


RESUME_HINT = "marinrl run --resume RUN_DIR"
"""Said by an error raised where the run directory is not known (a rollout worker's): the
driver puts the run's own resume command in its place (:func:`with_resume_command`)."""


def with_resume_command(error: MarinRLError, command: str) -> MarinRLError:
    """``error`` with :data:`RESUME_HINT` in its message replaced by ``command``."""
    if RESUME_HINT not in str(error):
        return error
    return type(error)(str(error).replace(RESUME_HINT, command))


class ConfigError(MarinRLError):
    """A config value is missing, unknown, mistyped or invalid. The message names its path."""

    exit_code = ExitCode.CONFIG


class FieldValueError(ValueError):
    """Raised by a config class's field validator: the error is reported at that field's path
    (``$.trainer.lr_schedule``) instead of the enclosing table's."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def one_of(*choices: str) -> Any:
    """An attrs validator accepting only ``choices``; the error lists them::

    split: str = attrs.field(default="swap", validator=one_of("swap", "hash"))
    """

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise FieldValueError(
                attribute.name,
                f"unknown {attribute.name} {value!r}; choose one of {', '.join(choices)}",
            )

    return check


class UnknownPluginError(MarinRLError):
    """A name that no loaded plugin registers for the requested kind."""

    exit_code = ExitCode.UNKNOWN_PLUGIN

    def __init__(
        self,
        kind: str,
        name: str,
        known: Iterable[str],
        *,
        where: str | None = None,
        disabled: Iterable[str] = (),
    ):
        known, disabled = sorted(known), sorted(disabled)
        self.kind, self.name, self.known = kind, name, known
        # Names are lowercase: `--loss RLOO` means rloo as surely as a typo does.
        by_lower = {k.lower(): k for k in known}
        close = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=1)]
        lines = [f"unknown {kind} {name!r}" + (f" (at {where})" if where else "") + "."]
        if name in disabled:
            lines.append(
                f"The plugin {name!r} is installed but disabled by --disable-plugin {name}: drop "
                "that flag to use it."
            )
        elif disabled:
            lines.append(f"Disabled with --disable-plugin: {', '.join(disabled)}.")
        if close:
            lines.append(f"Did you mean {close[0]!r}?")
        label = "Installed plugins" if kind == "plugin" else f"Registered {kind} plugins"
        lines.append(f"{label}: {', '.join(known) if known else '(none)'}.")
        lines.append("Run `marinrl plugins list` to see every plugin and where it comes from.")
        super().__init__("\n".join(lines))


class PluginImportError(MarinRLError):
    """A plugin module (from an entry point or ``--plugin``) raised while importing."""

    exit_code = ExitCode.PLUGIN_IMPORT


class DuplicatePluginError(MarinRLError):
    """Two or more plugins register the same name for one kind."""

    exit_code = ExitCode.DUPLICATE_PLUGIN


class PluginContractError(MarinRLError):
    """A plugin breaks the hook contract: a hookimpl that matches no hookspec, a bad record."""

    exit_code = ExitCode.PLUGIN_CONTRACT


class ResourcesUnavailableError(MarinRLError):
    """The cluster cannot place an actor: it lacks what ``[resources]`` asks for."""

    exit_code = ExitCode.RESOURCES


class FeatureNotAvailableError(MarinRLError):
    """The command resolved its inputs but asks for something this version cannot do."""

    exit_code = ExitCode.NOT_AVAILABLE


class ClusterError(MarinRLError):
    """The Ray cluster named by ``--ray-address`` does not answer or cannot be joined, or the
    job's own local Ray does not start."""

    exit_code = ExitCode.CLUSTER


class RunDirError(MarinRLError):
    """The run directory (or a file in it) cannot be written or read."""

    exit_code = ExitCode.RUN_DIR


class StalledError(MarinRLError):
    """No training step completed within ``watchdog.stall_timeout_s``; the message names the
    stalled stage and the counters that explain it."""

    exit_code = ExitCode.STALLED


class WorkerLostError(MarinRLError):
    """A trainer or rollout worker process died, and could not be (or was too often) restarted."""

    exit_code = ExitCode.WORKER_LOST


class WeightMismatchError(MarinRLError, ValueError):
    """Weights a rollout worker received do not fit its model (other leaves, dtypes or shapes):
    the trainer and the workers were built from different model configs."""

    exit_code = ExitCode.CONFIG
