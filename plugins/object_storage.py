"""The ``gcs`` rollout storage: each batch one object under any fsspec URL (``gs://``, ``s3://``,
``file://``, a local path), so rollout workers and the trainer share nothing but the bucket.

Layout under the run's prefix ``ROOT`` (``url/RUN_ID``; without a ``url``, ``RUN_DIR/rollouts``)::

    ROOT/writers/WRITER/000000000042.arrow   batch 42 of one writer (Arrow IPC, never pickle)
    ROOT/cursor.json                         how far the trainer has read each writer

``WRITER`` is the rollout worker's name plus a random suffix (``rollout-3-1f2e3d4c``): a worker
started again writes under a new name, so names are unique without coordination. Each writer
numbers its batches 0, 1, 2, ...; a batch is published atomically (object stores make an object
visible only once whole; a local file is written under a temporary name and renamed), so no
reader ever sees half a batch.

**Exactly once.** The reader keeps one cursor per writer (the next number to read) and asks for
exactly that object: a poll costs one request per writer and a listing of the ``writers/``
folder every ``list_interval_s``, however long the run. The cursors are the reader's position:
the trainer saves it with each checkpoint and a resumed trainer reads on from it. A write that
fails without knowing whether the object landed is retried under the same number with the same
bytes, so it cannot be stored twice. An object that cannot be decoded (truncated, foreign) is
counted (``corrupt_batches``), logged and skipped. A number that never arrives while the next
one has (a writer that gave up on a batch) is skipped after ``gap_timeout_s`` (``skipped_gaps``).

**Back-pressure.** The reader writes its cursors to ``cursor.json`` as it reads (at most every
``poll_interval_s``); a writer waits while ``max_unread_batches`` of its batches are unread, up
to its timeout, then raises ``TimeoutError`` with the batch not stored.

**Retention.** When a checkpoint holding them is written (``checkpointed``), the batches the
trainer had read are deleted (``retention = "checkpointed"``; ``"keep"`` keeps everything), and
with ``max_age_s`` any batch older than that too.

Every call is bounded (``call_timeout_s``) and retried with backoff (``retries``); a storage that
stops answering raises :class:`StorageUnavailableError` naming the URL.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from marin_rl_core import (
    ExitCode,
    MarinRLError,
    RolloutBatch,
    RunInfo,
    StoragePlugin,
    absolute_run_dir,
    hookimpl,
    one_of,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
CURSOR_FILE = "cursor.json"
SLOW_CALL_S = 10.0
"""A storage call unanswered for longer than this is named by ``trouble()`` (the watchdog)."""
TROUBLE_MEMORY_S = 120.0
"""How long ``trouble()`` keeps naming a call that failed (and was retried)."""


class StorageUnavailableError(MarinRLError):
    """Rollout storage did not answer within its timeout and retries."""

    exit_code = ExitCode.STORAGE


def _openable(instance: Any, attribute: Any, url: str) -> None:
    """A URL whose filesystem is installed (checked with the config, before anything starts)."""
    if not url:
        return
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = " (pip install 'marin-rl[s3]')" if protocol in ("s3", "s3a") else ""
        raise ValueError(f"{url!r} cannot be opened: {why}{hint}") from None


@attrs.frozen(kw_only=True)
class ObjectStorageConfig:
    """Config of the ``gcs`` rollout storage.

    Args:
        url: where batches go: any fsspec URL (``gs://bucket/prefix``, ``s3://...``,
            ``file:///...``) or a local path; the run's batches go under ``url/RUN_ID``. Empty:
            ``RUN_DIR/rollouts``.
        max_unread_batches: a writer waits while this many of its batches are unread (0: never
            waits).
        poll_interval_s: how often a waiting reader or writer looks again.
        list_interval_s: how often the reader looks for new writers.
        gap_timeout_s: a batch number that never arrives while the writer's next one has is
            skipped after this long.
        retention: ``"checkpointed"``: delete the batches a written checkpoint holds;
            ``"keep"``: delete nothing.
        max_age_s: also delete batches older than this at each checkpoint (0: off; lists each
            writer's folder).
        call_timeout_s: the longest one storage call may take before it is retried.
        retries: attempts after the first, with backoff, before a call fails.
    """

    url: str = attrs.field(default="", validator=_openable)
    max_unread_batches: int = attrs.field(default=16, validator=attrs.validators.ge(0))
    poll_interval_s: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    list_interval_s: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))
    gap_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    retention: str = attrs.field(default="checkpointed", validator=one_of("checkpointed", "keep"))
    max_age_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    call_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    retries: int = attrs.field(default=4, validator=attrs.validators.ge(0))


def _batch_name(seq: int) -> str:
    return f"{seq:012d}.arrow"


class _Bucket:
    """The storage's calls: each bounded by ``call_timeout_s`` and retried with backoff."""

    def __init__(self, root: str, config: ObjectStorageConfig):
        import fsspec

        self.root = root.rstrip("/")
        self.config = config
        # A filesystem of our own (fsspec caches them per URL) that never answers from a cached
        # listing: new writers and batches must show up on the next look.
        self.fs, self.path = fsspec.core.url_to_fs(
            self.root, skip_instance_cache=True, use_listings_cache=False
        )
        self.local = "file" in _protocols(self.fs)
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="marinrl-bucket")
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[str, float, int]] = {}  # what, since, attempt
        self._last_problem: tuple[float, str] = (-float("inf"), "")

    def trouble(self) -> str:
        """A call in flight for longer than :data:`SLOW_CALL_S`, or one that failed in the last
        :data:`TROUBLE_MEMORY_S` seconds, in a line naming the bucket; ``""`` when neither."""
        now = time.monotonic()
        with self._lock:
            slow = [(since, what, attempt) for what, since, attempt in self._in_flight.values()
                    if now - since > SLOW_CALL_S]  # fmt: skip
            when, problem = self._last_problem
        if slow:
            since, what, attempt = min(slow)
            tries = f" (attempt {attempt} of {self.config.retries + 1})" if attempt > 1 else ""
            return f"{what} on {self.root}: no answer for {now - since:.0f} s{tries}"
        if now - when < TROUBLE_MEMORY_S:
            return f"{problem} ({now - when:.0f} s ago)"
        return ""

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)``; ``FileNotFoundError`` passes straight through (an answer, not a
        failure); anything else, or no answer in time, is retried, then raised as
        :class:`StorageUnavailableError`. A slow or failing call shows in :meth:`trouble`."""
        c = self.config
        backoff, problem = 0.5, ""
        for attempt in range(c.retries + 1):
            future = self._pool.submit(fn, *args, **kwargs)
            token = id(future)
            with self._lock:
                self._in_flight[token] = (what, time.monotonic(), attempt + 1)
            try:
                return future.result(timeout=c.call_timeout_s)
            except FileNotFoundError:
                raise
            except concurrent.futures.TimeoutError:
                problem = f"no answer in {c.call_timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 - a storage error: retried, then reported
                problem = f"{type(exc).__name__}: {exc}"
            finally:
                with self._lock:
                    self._in_flight.pop(token, None)
            with self._lock:
                self._last_problem = (
                    time.monotonic(),
                    f"{what} on {self.root} failed: {problem[:200]} (attempt {attempt + 1})",
                )
            logger.warning(
                "%s on %s failed (%s); attempt %d", what, self.root, problem, attempt + 1
            )
            if attempt < c.retries:
                time.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
        raise StorageUnavailableError(
            f"rollout storage {self.root} did not answer: {what} failed {c.retries + 1} times "
            f"(last: {problem}). Check that the bucket exists and that this machine can reach "
            "it and has credentials for it; raise storage.call_timeout_s or storage.retries for "
            "a slow one"
        )

    def put(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` whole or not at all."""
        target = f"{self.path}/{rel}"
        if not self.local:
            self.call(f"writing {rel}", self.fs.pipe_file, target, data)
            return

        def atomic() -> None:
            folder, name = os.path.split(target)
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)

        self.call(f"writing {rel}", atomic)

    def get(self, rel: str) -> bytes | None:
        """The object at ``rel``, or ``None`` when there is none."""
        try:
            return self.call(f"reading {rel}", self.fs.cat_file, f"{self.path}/{rel}")
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return bool(self.call(f"looking for {rel}", self.fs.exists, f"{self.path}/{rel}"))

    def _entries(self, rel: str) -> list[dict[str, Any]]:
        try:
            return self.call(f"listing {rel}", self.fs.ls, f"{self.path}/{rel}", detail=True)
        except FileNotFoundError:
            return []

    def folders(self, rel: str) -> list[str]:
        """The names of the folders (prefixes) in ``rel``."""
        return sorted(
            os.path.basename(e["name"].rstrip("/"))
            for e in self._entries(rel)
            if e.get("type") == "directory"
        )

    def files(self, rel: str) -> list[dict[str, Any]]:
        return [e for e in self._entries(rel) if e.get("type") == "file"]

    def delete(self, rels: list[str]) -> None:
        for path in (f"{self.path}/{r}" for r in rels):  # one call each: a missing one is fine
            try:
                self.call(f"deleting {path}", self.fs.rm_file, path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


class ObjectRolloutWriter:
    """A rollout worker's end: its batches, numbered, under its own name."""

    def __init__(self, bucket: _Bucket, name: str):
        self._bucket = bucket
        self.name = f"{name or 'writer'}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self._unsure: tuple[bytes, int] | None = None
        self._lock = threading.Lock()
        self._unread_checked = (-1.0, 0)  # (when, the reader's cursor for this writer)

    def _read_upto(self, *, fresh: bool) -> int:
        when, upto = self._unread_checked
        if fresh or time.monotonic() - when > self._bucket.config.poll_interval_s:
            data = self._bucket.get(CURSOR_FILE)
            try:
                cursors = json.loads(data) if data else {}
                upto = int(cursors.get("writers", {}).get(self.name, 0))
            except (ValueError, TypeError, AttributeError):
                upto = 0  # a damaged cursor file: the reader writes it again as it reads
            self._unread_checked = (time.monotonic(), upto)
        return upto

    def _wait_for_room(self, seq: int, timeout: float | None) -> None:
        limit = self._bucket.config.max_unread_batches
        if limit == 0:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        fresh = False
        while seq - self._read_upto(fresh=fresh) >= limit:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rollout storage {self._bucket.root}: {limit} batches of {self.name} are "
                    f"still unread after {timeout} s, so the batch was not stored: the trainer is "
                    "reading rollouts more slowly than they are written. Raise "
                    "storage.max_unread_batches, lower num_rollout_workers, or pass a longer "
                    "timeout to write_batch."
                )
            time.sleep(self._bucket.config.poll_interval_s)
            fresh = True

    def write_batch(self, batch: RolloutBatch, *, timeout: float | None = None) -> None:
        """Store ``batch`` as this writer's next object; wait while too many of its batches are
        unread, up to ``timeout`` seconds, then raise ``TimeoutError`` (not stored). Any other
        error leaves it unknown whether the batch was stored: write the same batch again (it
        is stored once)."""
        from marin_rl_core import serialize_rollout_batch

        data = serialize_rollout_batch(batch)
        with self._lock:
            seq = self._seq
            if self._unsure is not None and self._unsure[0] == data:
                seq = self._unsure[1]  # the same batch again: the same object, same bytes
            self._wait_for_room(seq, timeout)
            try:
                self._bucket.put(f"writers/{self.name}/{_batch_name(seq)}", data)
            except BaseException:
                self._unsure = (data, seq)
                self._seq = max(self._seq, seq + 1)
                raise
            self._unsure = None
            self._seq = max(self._seq, seq + 1)


class ObjectRolloutReader:
    """The trainer's end: every published batch is returned by exactly one successful call."""

    def __init__(self, bucket: _Bucket, cursors: dict[str, int]):
        self._bucket = bucket
        self._cursors = dict(cursors)
        self._deleted: dict[str, int] = {}
        self._listed_at = -float("inf")
        self._missing_since: dict[str, float] = {}
        self._cursor_written: tuple[float, dict[str, int]] = (-float("inf"), {})
        self.counters = {"batches_read": 0, "corrupt_batches": 0, "skipped_gaps": 0}

    def position(self) -> dict[str, Any]:
        return {"root": self._bucket.root, "writers": dict(self._cursors)}

    def trouble(self) -> str:
        return self._bucket.trouble()

    def _discover(self, now: float) -> None:
        if now - self._listed_at < self._bucket.config.list_interval_s:
            return
        self._listed_at = now
        for name in self._bucket.folders("writers"):
            self._cursors.setdefault(name, 0)

    def _next(self, name: str, cursors: dict[str, int], now: float) -> RolloutBatch | None:
        """The next batch of writer ``name`` from ``cursors`` (advanced past it, or past an
        object that cannot be decoded), or ``None`` when it has not arrived."""
        from marin_rl_core import deserialize_rollout_batch

        while True:
            seq = cursors[name]
            rel = f"writers/{name}/{_batch_name(seq)}"
            data = self._bucket.get(rel)
            if data is None:
                if not self._gap(name, seq, now):
                    return None
                cursors[name] = seq + 1
                continue
            self._missing_since.pop(name, None)
            cursors[name] = seq + 1
            try:
                return deserialize_rollout_batch(data)
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign object is skipped
                self.counters["corrupt_batches"] += 1
                logger.error("skipped %s/%s: it is not a rollout batch (%s)", self._bucket.root,
                             rel, exc)  # fmt: skip

    def _gap(self, name: str, seq: int, now: float) -> bool:
        """Whether batch ``seq`` of ``name`` is to be skipped: missing for ``gap_timeout_s``
        while the writer's next one exists (looked for once per ``list_interval_s``)."""
        since = self._missing_since.setdefault(name, now)
        if now - since < self._bucket.config.gap_timeout_s:
            return False
        if not self._bucket.exists(f"writers/{name}/{_batch_name(seq + 1)}"):
            self._missing_since[name] = (
                now - self._bucket.config.gap_timeout_s + (self._bucket.config.list_interval_s)
            )
            return False
        self._missing_since.pop(name, None)
        self.counters["skipped_gaps"] += 1
        logger.warning("batch %d of writer %s never arrived; skipped", seq, name)
        return True

    def read_batches(self, *, max_batches: int, timeout: float = 0.0) -> list[RolloutBatch]:
        deadline = time.monotonic() + max(0.0, timeout)
        cursors = dict(self._cursors)  # committed only when the whole call succeeds
        out: list[RolloutBatch] = []
        while max_batches > 0:
            now = time.monotonic()
            self._discover(now)
            for name in sorted(set(self._cursors) | set(cursors)):
                cursors.setdefault(name, self._cursors.get(name, 0))
                while len(out) < max_batches:
                    batch = self._next(name, cursors, now)
                    if batch is None:
                        break
                    out.append(batch)
            if out or time.monotonic() >= deadline:
                break
            time.sleep(min(self._bucket.config.poll_interval_s, deadline - time.monotonic()))
        self._cursors = cursors
        self.counters["batches_read"] += len(out)
        self._write_cursor()
        return out

    def _write_cursor(self) -> None:
        """Tell waiting writers how far the trainer has read (at most every poll interval)."""
        when, written = self._cursor_written
        if written == self._cursors:
            return
        if time.monotonic() - when < self._bucket.config.poll_interval_s:
            return
        try:
            self._bucket.put(CURSOR_FILE, json.dumps({"writers": self._cursors}).encode())
        except StorageUnavailableError:
            logger.warning("could not write %s/%s; writers may wait", self._bucket.root,
                           CURSOR_FILE, exc_info=True)  # fmt: skip
            return
        self._cursor_written = (time.monotonic(), dict(self._cursors))

    def checkpointed(self, position: Any) -> None:
        """Delete the batches a written checkpoint holds (``retention``), and those older than
        ``max_age_s``. Failures are logged: deleting is retried at the next checkpoint."""
        config = self._bucket.config
        try:
            if config.retention == "checkpointed" and isinstance(position, dict):
                for name, upto in dict(position.get("writers", {})).items():
                    start = self._deleted.get(name, 0)
                    names = [f"writers/{name}/{_batch_name(s)}" for s in range(start, int(upto))]
                    self._bucket.delete(names)
                    self._deleted[name] = max(start, int(upto))
            if config.max_age_s > 0:
                old = time.time() - config.max_age_s
                for name in self._bucket.folders("writers"):
                    for entry in self._bucket.files(f"writers/{name}"):
                        modified = _modified(entry)
                        if modified is not None and modified < old:
                            rel = f"writers/{name}/{os.path.basename(entry['name'])}"
                            self._bucket.delete([rel])
        except StorageUnavailableError:
            logger.warning("deleting trained-on batches failed; retried at the next checkpoint",
                           exc_info=True)  # fmt: skip


def _modified(entry: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        value = entry.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            from datetime import datetime

            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


class ObjectRolloutStorage:
    """A handle on the run's prefix; picklable (the URL and config only)."""

    def __init__(self, config: ObjectStorageConfig, root: str):
        self.config = config
        self.root = root
        self._bucket: _Bucket | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config, self.root, self._bucket = state["config"], state["root"], None

    def bucket(self) -> _Bucket:
        if self._bucket is None:
            self._bucket = _Bucket(self.root, self.config)
        return self._bucket

    def writer(self, *, name: str = "") -> ObjectRolloutWriter:
        return ObjectRolloutWriter(self.bucket(), name)

    def reader(self, position: Any = None) -> ObjectRolloutReader:
        """The trainer's reader, going on from ``position`` when it is of this prefix."""
        cursors: dict[str, int] = {}
        if isinstance(position, dict) and position.get("root") == self.root:
            cursors = {str(k): int(v) for k, v in dict(position.get("writers", {})).items()}
        return ObjectRolloutReader(self.bucket(), cursors)

    def check(self) -> None:
        """A bucket answers (a lookup of the run's prefix, with the storage's timeout and
        retries), before the job starts; a local directory is the run directory's check.

        Raises:
            StorageUnavailableError: naming the bucket, the call and what to check.
        """
        bucket = self.bucket()
        if not bucket.local:
            bucket.call("looking up the run's prefix", bucket.fs.exists, bucket.path)

    def close(self) -> None:
        """Nothing to release but connections: the batches stay (retention deletes them)."""
        if self._bucket is not None:
            self._bucket.close()
            self._bucket = None


def build_object_storage(config: ObjectStorageConfig, run: RunInfo) -> ObjectRolloutStorage:
    if config.url:
        root = f"{config.url.rstrip('/')}/{run.run_id}"
    else:
        # Beside the run: on its bucket for a run directory on one (gs://...), else on disk.
        root = str(absolute_run_dir(run.run_dir) / "rollouts")
    return ObjectRolloutStorage(config, root)


@hookimpl
def marinrl_register_storages():
    yield StoragePlugin(
        name="gcs",
        summary="Each batch one object under any fsspec URL (gs://, s3://, a path): exactly once "
        "across restarts.",
        config_class=ObjectStorageConfig,
        build=build_object_storage,
    )
