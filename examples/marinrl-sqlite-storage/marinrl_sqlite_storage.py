"""``sqlite``: an example third-party marinrl rollout storage, each batch one row of an SQLite file.

The file is ``RUN_DIR/rollouts.sqlite``, on this machine's disk: every process of the job opens
it, so the job runs on one machine (SQLite's locks do not hold over a network filesystem). What
the storage contract asks, and how this module does it:

* **Back-pressure**: a writer waits while ``max_unread_batches`` batches are unread (the trainer
  records how far it has read in the file), up to its timeout, then raises ``TimeoutError``
  with the batch not stored.
* **Stored once**: a row's key is the SHA-256 of the batch's bytes. A worker that writes a batch
  again after an error writes the same bytes, and an existing key means "stored already".
* **Read once, across restarts**: rows are numbered as they are stored; the reader's position
  is the number of the last row it returned, and a resumed trainer reads the rows after it.
* **Retention**: ``checkpointed(position)`` empties the rows a checkpoint holds; their keys stay,
  so a late retry of one is still recognised.

Batches are Arrow bytes (``serialize_rollout_batch``), never pickles. The storage object is a
handle (the file's path); each writer and reader opens its own connection on first use, in the
process that uses it. Try it::

    pip install ./examples/marinrl-sqlite-storage
    marinrl run --storage sqlite
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
import time
import uuid
from typing import Any

import attrs

from marin_rl_core import ConfigError, RolloutBatch, RunInfo, StoragePlugin, hookimpl

logger = logging.getLogger(__name__)
SLOW_CALL_S = 10.0  # trouble() names a call to the database that has waited longer than this
SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order rows are read in
    digest TEXT NOT NULL UNIQUE,            -- the batch's identity: SHA-256 of its bytes
    writer TEXT NOT NULL,
    data BLOB                               -- NULL once a checkpoint holds the batch
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
"""


@attrs.frozen(kw_only=True)
class SqliteStorageConfig:
    """Args:
    max_unread_batches: writers wait while this many batches are unread.
    poll_interval_s: how often a waiting writer or reader looks again.
    lock_timeout_s: the longest one call waits for another process's lock on the file.
    """

    max_unread_batches: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    poll_interval_s: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    lock_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))


class _Database:
    """One process's connection to the file, opened on first use; records a slow or failed
    call for ``trouble()``."""

    def __init__(self, path: str, config: SqliteStorageConfig):
        self.path, self.config = path, config
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self.since: float | None = None  # when the call in progress began
        self.failed = ""

    def call(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """The rows of ``sql``: one statement, so one transaction (atomic, as SQLite runs it)."""
        with self._lock:
            self.since = time.monotonic()
            try:
                if self._connection is None:
                    self._connection = sqlite3.connect(
                        self.path, timeout=self.config.lock_timeout_s, isolation_level=None,
                        check_same_thread=False,
                    )  # fmt: skip
                rows = self._connection.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                self.since = None
            self.failed = ""
            return rows

    def trouble(self) -> str:
        since = self.since
        if since is not None and time.monotonic() - since > SLOW_CALL_S:
            waited = time.monotonic() - since
            return f"sqlite rollout storage {self.path}: a call has waited {waited:.0f} s"
        return f"sqlite rollout storage {self.path}: {self.failed}" if self.failed else ""


# Stores a batch if fewer than ? batches are unread, and gives its number; nothing if it was
# stored before (IGNORE: its key exists) or storage is full.
INSERT = """
INSERT OR IGNORE INTO batches (digest, writer, data) SELECT ?, ?, ?
WHERE (SELECT COUNT(*) FROM batches WHERE seq > (SELECT value FROM meta WHERE key = 'read_upto')) < ?
RETURNING seq
"""


class SqliteRolloutWriter:
    def __init__(self, db: _Database, name: str):
        self._db, self.name = db, name or "writer"

    def write_batch(self, batch: RolloutBatch, *, timeout: float | None = None) -> None:
        from marin_rl_core import serialize_rollout_batch

        data = serialize_rollout_batch(batch)
        digest = hashlib.sha256(data).hexdigest()
        limit, poll = self._db.config.max_unread_batches, self._db.config.poll_interval_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._db.call(INSERT, (digest, self.name, data, limit)):
                return  # stored now
            if self._db.call("SELECT 1 FROM batches WHERE digest = ?", (digest,)):
                return  # stored by an earlier try: the same batch again
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"sqlite rollout storage {self._db.path}: {limit} batches are still unread "
                    f"after {timeout} s, so the batch was not stored: the trainer reads rollouts "
                    "more slowly than they are written. Raise storage.max_unread_batches or "
                    "lower num_rollout_workers."
                )
            time.sleep(poll if left is None else min(poll, left))


class SqliteRolloutReader:
    def __init__(self, db: _Database, store_id: str, after: int):
        self._db, self._store_id, self._after = db, store_id, after
        self._published: int | None = None  # the read position the writers last saw

    def position(self) -> dict[str, Any]:
        return {"sqlite": self._store_id, "after": self._after}

    def trouble(self) -> str:
        return self._db.trouble()

    def read_batches(self, *, max_batches: int, timeout: float = 0.0) -> list[RolloutBatch]:
        from marin_rl_core import deserialize_rollout_batch

        deadline = time.monotonic() + max(0.0, timeout)
        rows: list[Any] = []
        while max_batches > 0:
            rows = self._db.call(
                "SELECT seq, data FROM batches WHERE seq > ? AND data IS NOT NULL "
                "ORDER BY seq LIMIT ?", (self._after, max_batches),
            )  # fmt: skip
            left = deadline - time.monotonic()
            if rows or left <= 0:
                break
            time.sleep(min(self._db.config.poll_interval_s, left))
        batches = [deserialize_rollout_batch(data) for _, data in rows]  # raises: nothing moved
        if rows:
            self._after = rows[-1][0]
        self._publish()
        return batches

    def _publish(self) -> None:
        """Tell the writers how far the trainer has read (they count the unread rows)."""
        if self._published == self._after:
            return
        try:
            self._db.call("UPDATE meta SET value = ? WHERE key = 'read_upto'", (self._after,))
            self._published = self._after
        except sqlite3.Error:
            logger.warning("could not record the read position; writers may wait", exc_info=True)

    def checkpointed(self, position: Any) -> None:
        """Empty the rows a written checkpoint holds; keep their keys (late retries)."""
        if not (isinstance(position, dict) and position.get("sqlite") == self._store_id):
            return
        try:
            self._db.call("UPDATE batches SET data = NULL WHERE seq <= ? AND data IS NOT NULL",
                          (int(position["after"]),))  # fmt: skip
        except sqlite3.Error:
            logger.warning("could not forget checkpointed batches; retried at the next one",
                           exc_info=True)  # fmt: skip


class SqliteRolloutStorage:
    """A handle on the file (its path and id), picklable to the job's workers."""

    def __init__(self, config: SqliteStorageConfig, path: str, store_id: str):
        self.config, self.path, self.store_id = config, path, store_id

    def writer(self, *, name: str = "") -> SqliteRolloutWriter:
        return SqliteRolloutWriter(_Database(self.path, self.config), name)

    def reader(self, position: Any = None) -> SqliteRolloutReader:
        """Reads on after ``position`` when it is of this file; from the start otherwise."""
        after = 0
        if isinstance(position, dict) and position.get("sqlite") == self.store_id:
            after = int(position.get("after", 0))
        return SqliteRolloutReader(_Database(self.path, self.config), self.store_id, after)

    def close(self) -> None:
        """Nothing to release: connections close with their processes, and the file stays (a
        resumed run reads on from it)."""


def build(config: SqliteStorageConfig, run: RunInfo) -> SqliteRolloutStorage:
    """Create the file (once, in the driver: the workers only connect) and return its handle."""
    from marin_rl_core import absolute_run_dir

    run_dir = absolute_run_dir(run.run_dir)
    if "://" in str(run_dir):
        raise ConfigError(
            f"the sqlite rollout storage keeps its file on this machine, but the run directory "
            f"is {run_dir}; use a local run_dir, or --storage gcs for a bucket"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    path = str(run_dir / "rollouts.sqlite")
    with sqlite3.connect(path, timeout=config.lock_timeout_s) as connection:
        connection.execute("PRAGMA journal_mode=WAL")  # readers never block the writers
        connection.executescript(SCHEMA)
        connection.execute("INSERT OR IGNORE INTO meta VALUES ('id', ?), ('read_upto', 0)",
                           (uuid.uuid4().hex,))  # fmt: skip
        (store_id,) = connection.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
    connection.close()
    return SqliteRolloutStorage(config, path, store_id)


@hookimpl
def marinrl_register_storages():
    yield StoragePlugin(
        name="sqlite",
        summary="Each rollout batch a row of an SQLite file in the run directory (one machine; "
        "example).",
        config_class=SqliteStorageConfig,
        build=build,
    )
