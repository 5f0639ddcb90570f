"""Run directories on a local disk or on a bucket (any fsspec URL: ``gs://``, ``s3://``, ...).

A run directory holds ``config.toml``, ``checkpoints/``, ``metrics.jsonl``, ``samples.jsonl``,
``logs/`` and ``reward_curve.png``. A local one is written in place. On a bucket
(``--set run_dir=gs://bucket/runs``):

- ``config.toml`` and the checkpoints are written to the bucket directly, as whole objects
  (levanter's TensorStore checkpoints write ``gs://`` themselves); a checkpoint counts once its
  ``state.json``, written last, is there.
- The files that grow a line at a time (``metrics.jsonl``, ``samples.jsonl``, ``logs/*.log``:
  object stores cannot append) are appended to in a local copy of the run directory,
  :func:`local_copy` (``~/.cache/marinrl/runs/BUCKET/PATH``, or under ``$MARINRL_CACHE_DIR``),
  and each process uploads the ones it writes every :data:`UPLOAD_INTERVAL_S` seconds, after
  each checkpoint and when it stops. A process that starts on a run (a resume, perhaps on
  another machine) first takes the bucket's copy of each such file where it is longer than
  the local one, so the history goes on.

Paths are :class:`pathlib.Path` for local runs and ``upath.UPath`` (pathlib's interface over
fsspec) for URLs: ``run_path(d) / "checkpoints"`` works on both.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

UPLOAD_INTERVAL_S = 30.0
"""How often a process uploads the growing files it writes to a run directory on a bucket."""

logger = logging.getLogger(__name__)


def is_remote(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` is a URL of a filesystem other than the local one."""
    text = str(run_dir)
    return "://" in text and not text.startswith("file://")


def run_path(run_dir: str | os.PathLike[str]) -> Path:
    """``run_dir`` as a path object: a ``UPath`` for a URL (``gs://b/runs/rl-1``), otherwise a
    local :class:`Path` (``file://`` stripped, ``~`` expanded)."""
    if isinstance(run_dir, Path) and not is_remote(run_dir):
        return run_dir
    text = str(run_dir)
    if is_remote(text):
        from upath import UPath

        # No cached listings: other processes (the trainer, another machine) write there, and
        # a cached size would read a grown file short.
        return UPath(text.rstrip("/"), use_listings_cache=False)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return Path(text).expanduser()


def absolute(run_dir: str | os.PathLike[str]) -> Path:
    """``run_dir`` as an absolute path (a URL is one already)."""
    path = run_path(run_dir)
    return path if is_remote(path) else path.absolute()


def cache_dir(part: str = "runs") -> Path:
    """marinrl's cache directory ``part``: ``$MARINRL_CACHE_DIR/PART`` (default
    ``~/.cache/marinrl/PART``): ``runs`` holds the local copies of runs on buckets,
    ``model-counts`` the memory check's parameter counts (:mod:`marin_rl_core.job.memory`),
    ``transformers-index`` transformers' index of its model files
    (:mod:`marin_rl_core.deferred_imports`)."""
    base = os.environ.get("MARINRL_CACHE_DIR") or os.path.join("~", ".cache", "marinrl")
    return Path(base).expanduser() / part


def local_copy(run_dir: str | os.PathLike[str]) -> Path:
    """The local directory where the growing files of ``run_dir`` are written: the run
    directory itself for a local run, :func:`cache_dir` ``/SCHEME/BUCKET/PATH`` for a URL."""
    if not is_remote(run_dir):
        return run_path(run_dir)
    parts = urlsplit(str(run_dir).rstrip("/"))
    return cache_dir() / parts.scheme / parts.netloc / parts.path.lstrip("/")


def remove_tree(path: Path) -> None:
    """Delete the directory ``path`` and everything under it; nothing if it is not there."""
    if is_remote(path):
        try:
            path.fs.rm(path.path, recursive=True)  # type: ignore[attr-defined]
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a local file through a temporary name and a rename;
    an object in one upload (object stores publish whole objects)."""
    if is_remote(path):
        path.write_text(text, encoding="utf-8")
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


class _Uploads:
    """This process's growing files of runs on buckets, uploaded by one daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[tuple[str, str], tuple[int, int] | None] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, run_dir: str, relative: str) -> None:
        with self._lock:
            self._files.setdefault((run_dir, relative), None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="marinrl-run-uploads", daemon=True
                )
                self._thread.start()
                atexit.register(self.flush)

    def _loop(self) -> None:
        while True:
            self._wake.wait(UPLOAD_INTERVAL_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> list[str]:
        """Upload every registered file that changed since its last upload; returns the
        problems (logged, never raised: a bucket that does not answer for a while must not
        stop training, and the next round tries again)."""
        problems = []
        with self._lock:
            for (run_dir, relative), seen in list(self._files.items()):
                local = local_copy(run_dir) / relative
                try:
                    stat = local.stat()
                except FileNotFoundError:
                    continue
                if seen == (stat.st_size, stat.st_mtime_ns):
                    continue
                target = run_path(run_dir) / relative
                try:
                    target.fs.put_file(str(local), target.path)  # type: ignore[attr-defined]
                except Exception as exc:  # noqa: BLE001 - any failure: try again next round
                    problems.append(f"{target}: {type(exc).__name__}: {exc}")
                    logger.warning("could not upload %s to %s: %s", local, target, exc)
                    continue
                self._files[(run_dir, relative)] = (stat.st_size, stat.st_mtime_ns)
        return problems


_UPLOADS = _Uploads()


def growing_file(run_dir: str | os.PathLike[str], relative: str) -> Path:
    """The local path where this process appends the run's file ``relative``
    (``"metrics.jsonl"``, ``"logs/trainer.log"``), its folder created.

    For a run on a bucket the file is in :func:`local_copy`: the bucket's copy is fetched
    first when it is longer than the local one (the run goes on from another machine or a
    cleared cache), and the file is uploaded from then on (:func:`upload_now`, and every
    :data:`UPLOAD_INTERVAL_S` seconds)."""
    local = local_copy(run_dir) / relative
    local.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(run_dir):
        url = str(run_path(run_dir))
        _fetch_if_longer(run_path(url) / relative, local)
        _UPLOADS.add(url, relative)
    return local


def _fetch_if_longer(remote: Path, local: Path) -> None:
    try:
        size = remote.fs.size(remote.path)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return
    if size is not None and size > (local.stat().st_size if local.exists() else -1):
        remote.fs.get_file(remote.path, str(local))  # type: ignore[attr-defined]
        logger.info("took %s from %s (%d bytes)", local, remote, size)


def upload_now() -> list[str]:
    """Upload this process's changed growing files of runs on buckets now (after a checkpoint,
    before stopping); returns the problems, which are also logged."""
    return _UPLOADS.flush()


def put(local: Path, run_dir: str | os.PathLike[str], relative: str) -> Any:
    """Copy the finished local file ``local`` to ``run_dir/relative`` when the run is on a
    bucket (a plot written after the run); returns where the run keeps it."""
    target = run_path(run_dir) / relative
    if is_remote(target):
        target.fs.put_file(str(local), target.path)  # type: ignore[attr-defined]
    return target
