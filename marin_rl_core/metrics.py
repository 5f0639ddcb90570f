"""Where a run's metrics go: ``metrics.jsonl`` in the run directory, plus optional trackers.

Every row is one JSON object with a ``step`` (the trainer step whose weights the numbers are
about), a ``source`` (``train``, ``rollout``, ``eval``) and a wall-clock ``time``. The trainer and
each rollout worker send rows to one :class:`MetricsHub` (a Ray actor in a job), which appends
them to the file, forwards them to wandb/tensorboard through levanter's trackers when configured,
and remembers the latest values for the driver's progress bar. Being the one actor every worker
finds by name, it also keeps which processes each rollout worker has had, so that the driver can
count restarts Ray made while a worker was still setting up.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from marin_rl_core.rundir import growing_file, local_copy, run_path, upload_now, write_text

METRICS_FILE = "metrics.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
"""A few decoded rollouts of each lesson at each eval (``logging.samples_per_step``)."""


def _plain(value: Any) -> Any:
    """Numbers from numpy/JAX as plain floats; NaN/inf as strings JSON can hold."""
    try:
        import numpy as np

        if isinstance(value, np.generic | np.ndarray):
            value = value.item() if np.ndim(value) == 0 else value.tolist()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsHub:
    """Collects metric rows from every worker of a run (see the module docstring).

    Args:
        run_dir: the run directory; rows go to ``run_dir/metrics.jsonl`` (appended to in the
            local copy of a run on a bucket and uploaded: :mod:`marin_rl_core.rundir`).
        trackers: extra trackers, ``"wandb"`` and/or ``"tensorboard"`` (``"jsonl"`` is always on).
        run_id: the run's name for external trackers.
    """

    def __init__(self, run_dir: str, trackers: Iterable[str] = (), run_id: str = ""):
        self.run_dir = run_dir
        self.path = growing_file(run_dir, METRICS_FILE)
        self._file = self.path.open("a", buffering=1)
        self._latest: dict[str, Any] = {}
        self._tracker_step = 0
        self._external = [
            _make_tracker(name, run_dir, run_id) for name in trackers if name != "jsonl"
        ]
        self._processes: dict[int, list[int]] = {}

    def worker_started(self, index: int, pid: int) -> None:
        """Rollout worker ``index`` started setting up in process ``pid`` (again, when Ray
        restarted it)."""
        self._processes.setdefault(int(index), []).append(int(pid))

    def worker_processes(self, index: int) -> list[int]:
        """The processes rollout worker ``index`` has had, oldest first."""
        return list(self._processes.get(int(index), []))

    def log(self, metrics: Mapping[str, Any], *, step: int, source: str) -> None:
        row = {"step": int(step), "source": source, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._latest.update(row)
        self._latest[f"{source}_step"] = int(step)
        try:
            self._file.write(json.dumps(row) + "\n")
        except OSError as exc:  # a full disk: the driver stops the job and says so
            self._latest.setdefault("write_error", {"path": str(self.path), "errno": exc.errno,
                                                    "strerror": exc.strerror})  # fmt: skip
        if self._external:
            # wandb refuses a step lower than one it has seen: rows stamped with a lagging
            # weight step (rollouts, evals) go at the newest step, their own step kept as the
            # "step" value.
            self._tracker_step = max(self._tracker_step, int(step))
            numbers = {k: v for k, v in row.items() if isinstance(v, int | float)}
            for tracker in self._external:
                tracker.log(numbers, step=self._tracker_step)

    def samples(self, rows: list[dict[str, Any]]) -> None:
        """Append the decoded held-out rollouts of an eval (``source`` ``"eval"``) to
        ``eval_samples.jsonl`` (a full disk: left out; ``metrics.jsonl`` reports it)."""
        try:
            with growing_file(self.run_dir, EVAL_SAMPLES_FILE).open("a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))
        except OSError:
            pass

    def resume_at(self, step: int) -> int:
        """A run resumed from the checkpoint of ``step``: drop the rows of later steps (the dead
        run logged them, and they are about to be trained again), and the eval rows of ``step``
        itself (the resumed run evaluates its starting weights again: a finished run extended
        would otherwise log its final eval twice), so that every step has one set of rows.
        A row of source ``run`` (``run/resumed_from``) marks where the resumed run starts (the
        summary's seconds leave out the time between the runs). Returns the number of rows
        dropped."""
        self._file.close()
        try:
            samples = growing_file(self.run_dir, EVAL_SAMPLES_FILE)
            drop_rows_after(samples, step, eval_too=True)
            return drop_rows_after(self.path, step, eval_too=True)
        finally:
            self._file = self.path.open("a", buffering=1)
            self.log({"run/resumed_from": step}, step=step, source="run")

    def latest(self) -> dict[str, Any]:
        """The most recent value of every metric (plus ``<source>_step``, and ``write_error``
        once a row could not be written to ``metrics.jsonl``)."""
        return dict(self._latest)

    def upload(self) -> None:
        """Upload ``metrics.jsonl`` now when the run directory is on a bucket (the trainer asks
        after each checkpoint, so a resume elsewhere finds the rows up to it)."""
        upload_now()

    def close(self) -> None:
        self._file.close()
        upload_now()
        for tracker in self._external:
            tracker.finish()


def _make_tracker(name: str, run_dir: str, run_id: str) -> Any:
    if name == "wandb":
        import os

        from levanter.tracker.wandb import WandbConfig

        # wandb's local files stay with the run (its local copy, for a run on a bucket)
        os.environ.setdefault("WANDB_DIR", str(local_copy(run_dir)))
        return WandbConfig(
            project=os.environ.get("WANDB_PROJECT", "marinrl"),
            entity=os.environ.get("WANDB_ENTITY") or None,
            name=run_id or None,
            save_code=False,
        ).init(run_id or None)  # the same run id resumes the same wandb run
    if name == "tensorboard":
        from levanter.tracker.tensorboard import TensorboardConfig

        logdir = local_copy(run_dir) / "tensorboard"
        return TensorboardConfig(logdir=str(logdir)).init(run_id or None)
    raise ValueError(f"unknown tracker {name!r}")


def drop_rows_after(path: str | Path, step: int, *, eval_too: bool = False) -> int:
    """Rewrite the JSON-lines file ``path`` without its rows of steps after ``step`` (and its
    damaged lines; with ``eval_too``, its ``"eval"`` rows of ``step`` as well), keeping the
    ``"run"`` rows that mark where resumed runs started; returns how many lines went. A missing
    file has none."""
    path = Path(path)
    if not path.exists():
        return 0
    rows = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = []
    for line in rows:
        try:
            row = json.loads(line)
            at = int(row["step"])
            if row.get("source") == "run":
                pass  # where a resumed run started: its time is not counted twice
            elif at > step or (eval_too and at == step and row.get("source") == "eval"):
                continue
        except (ValueError, KeyError, TypeError):
            continue  # a damaged or partly written line
        kept.append(line)
    dropped = len(rows) - len(kept)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))  # whole or not at all
    return dropped


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's ``metrics.jsonl``; damaged lines are skipped
    (:func:`read_metrics_counted` also counts them)."""
    return read_metrics_counted(run_dir)[0]


def read_metrics_counted(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """``(rows, damaged)``: the readable rows of a run's ``metrics.jsonl`` and how many lines
    were skipped. A row is a JSON object with an integer ``step`` and a string ``source`` (as
    :meth:`MetricsHub.log` writes them); anything else (a partly written last line, bytes a
    crash or a disk error spoiled, ``null``, a list, a row without a step) is damaged and spoils
    only its own line."""
    path = run_path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a marinrl run directory?")
    rows, damaged = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if (
            isinstance(row, dict)
            and isinstance(row.get("step"), int)
            and isinstance(row.get("source"), str)
            and isinstance(row.get("time", 0.0), int | float)
        ):
            rows.append(row)
        else:
            damaged += 1
    return rows, damaged


def device_memory() -> dict[str, float]:
    """This process's accelerator memory in GiB, the most over its devices: ``device_memory_gib``
    in use now and ``device_peak_memory_gib``, the most in use at once since the process started
    (a colocated process's training and sampling both); and ``host_peak_rss_gib``, the most
    host memory the process has held resident (what the memory check's CPU estimate is checked
    against; :mod:`marin_rl_core.job.memory`)."""
    import resource
    import sys

    import jax

    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
    host = {"host_peak_rss_gib": peak_rss / (2**30 if sys.platform == "darwin" else 2**20)}

    now = peak = -1
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - a platform without memory statistics
            stats = None
        if stats:
            now = max(now, int(stats.get("bytes_in_use", 0)))
            peak = max(peak, int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))))
    if now < 0:
        return host
    return {**host, "device_memory_gib": now / 2**30, "device_peak_memory_gib": peak / 2**30}
