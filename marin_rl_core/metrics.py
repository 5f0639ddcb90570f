"""Where a run's metrics go: ``metrics.jsonl`` in the run directory, plus optional trackers.

Every row is one JSON object with a ``step`` (the trainer step whose weights the numbers are
about), a ``source`` (``train``, ``rollout``, ``eval``) and a wall-clock ``time``. The trainer and
each rollout worker send rows to one :class:`MetricsHub` (a Ray actor in a job), which appends
them to the file, forwards them to wandb/tensorboard through levanter's trackers when configured,
and remembers the latest values for the driver's progress bar.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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
        run_dir: the run directory; rows go to ``run_dir/metrics.jsonl``.
        trackers: extra trackers, ``"wandb"`` and/or ``"tensorboard"`` (``"jsonl"`` is always on).
        run_id: the run's name for external trackers.
    """

    def __init__(self, run_dir: str, trackers: Iterable[str] = (), run_id: str = ""):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._latest: dict[str, Any] = {}
        self._external = [
            _make_tracker(name, run_dir, run_id) for name in trackers if name != "jsonl"
        ]

    def log(self, metrics: Mapping[str, Any], *, step: int, source: str) -> None:
        row = {"step": int(step), "source": source, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._latest.update(row)
        self._latest[f"{source}_step"] = int(step)
        for tracker in self._external:
            tracker.log(
                {k: v for k, v in row.items() if isinstance(v, int | float)}, step=int(step)
            )

    def latest(self) -> dict[str, Any]:
        """The most recent value of every metric (plus ``<source>_step``)."""
        return dict(self._latest)

    def close(self) -> None:
        self._file.close()
        for tracker in self._external:
            tracker.finish()


def _make_tracker(name: str, run_dir: str, run_id: str) -> Any:
    if name == "wandb":
        import os

        from levanter.tracker.wandb import WandbConfig

        os.environ.setdefault("WANDB_DIR", str(run_dir))  # wandb's local files stay with the run
        return WandbConfig(
            project=os.environ.get("WANDB_PROJECT", "marinrl"),
            entity=os.environ.get("WANDB_ENTITY") or None,
            name=run_id or None,
            save_code=False,
        ).init(run_id or None)  # the same run id resumes the same wandb run
    if name == "tensorboard":
        from levanter.tracker.tensorboard import TensorboardConfig

        return TensorboardConfig(logdir=str(Path(run_dir) / "tensorboard")).init(run_id or None)
    raise ValueError(f"unknown tracker {name!r}")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's ``metrics.jsonl``; a partly written last line is skipped."""
    path = Path(run_dir) / METRICS_FILE
    rows = []
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a marinrl run directory?")
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
