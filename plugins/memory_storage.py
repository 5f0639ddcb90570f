"""The ``memory`` rollout storage: a bounded queue held by one Ray actor of the job.

Rollout workers put Arrow IPC bytes (:mod:`marin_rl_core.rollout_serialization`) into the queue
actor; the trainer takes them out. The queue holds at most ``capacity`` batches: a writer waits
while it is full (back-pressure), up to its timeout, then gets ``TimeoutError`` and the batch is
*not* stored.

Every batch is delivered exactly once:

* **writes**: each writer numbers its batches and the queue ignores a number it has already
  accepted. A write that fails without knowing whether the queue took the batch (a lost reply)
  keeps its number, and writing the same batch again reuses it, so the retry cannot store it
  twice.
* **reads**: the queue numbers the batches it accepts, and a batch stays in the queue until the
  reader acknowledges it. Each read asks for the batches after the last one the reader has
  received (its *position*); that acknowledges, and removes, everything up to there. A read whose
  reply is lost, or whose batches fail to decode, leaves the position where it was, so the next
  read gets the same batches again.

Nothing outlives the Ray cluster: the queue is in memory only. The storage object is a small
picklable handle (queue name and namespace); the queue actor is created, or looked up, on first
use by whichever process gets there first. It is detached so that it survives the process that
happened to create it; :meth:`MemoryRolloutStorage.close` removes it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import uuid
from typing import Any

import attrs

from marin_rl_core import RolloutBatch, RunInfo, StoragePlugin, hookimpl


@attrs.frozen(kw_only=True)
class MemoryStorageConfig:
    """Config of the ``memory`` rollout storage.

    Args:
        capacity: the most batches the queue holds before writers wait. Small keeps rollout
            workers from racing ahead of the trainer with soon-stale weights.
        queue_name: the Ray actor name of the queue; empty picks a fresh unique name at build,
            so two jobs on one cluster never share a queue.
        namespace: the Ray namespace the queue actor is registered in.
    """

    capacity: int = 4
    queue_name: str = ""
    namespace: str = "marinrl"

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"memory storage capacity must be >= 1 batch, got {self.capacity}")


class RolloutQueue:
    """The queue actor's body: a bounded FIFO of serialized batches (a Ray async actor)."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        # (number, data): numbered in acceptance order; kept until the reader acknowledges them.
        self._items: collections.deque[tuple[int, bytes]] = collections.deque()
        self._changed = asyncio.Condition()
        self._next_seq: dict[str, int] = {}
        self._accepted = 0
        self._acknowledged = 0
        self._redelivered = 0
        self._delivered_upto = 0  # the highest number ever handed to the reader
        self._timeouts = 0
        self._duplicates = 0

    async def _wait(self, predicate: Any, timeout: float | None) -> bool:
        """Wait (holding the condition's lock) until ``predicate()``; False on timeout."""
        if predicate():
            return True
        if timeout is not None and timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
        except TimeoutError:
            return False
        return True

    def _has_room(self) -> bool:
        """Capacity counts the batches not yet handed to the reader (delivered ones wait only
        for its acknowledgement)."""
        return self._accepted - self._delivered_upto < self._capacity

    async def put(self, writer_id: str, seq: int, data: bytes, timeout: float | None) -> str:
        """Append ``data`` unless ``seq`` from ``writer_id`` was already accepted.

        Returns ``"accepted"``, ``"duplicate"`` (accepted earlier; nothing done) or
        ``"timeout"`` (the queue stayed full; nothing stored).
        """
        async with self._changed:
            if seq < self._next_seq.get(writer_id, 0):
                self._duplicates += 1
                return "duplicate"
            if not await self._wait(self._has_room, timeout):
                self._timeouts += 1
                return "timeout"
            if seq < self._next_seq.get(writer_id, 0):  # a concurrent retry got in first
                self._duplicates += 1
                return "duplicate"
            self._accepted += 1
            self._items.append((self._accepted, data))
            self._next_seq[writer_id] = seq + 1
            self._changed.notify_all()
            return "accepted"

    async def take(self, after: int, max_batches: int, timeout: float) -> list[tuple[int, bytes]]:
        """Acknowledge (remove) every batch numbered ``<= after``, then return up to
        ``max_batches`` of the next ones with their numbers, waiting up to ``timeout`` s for one.
        Returned batches stay queued until a later call acknowledges them."""
        async with self._changed:
            after = min(after, self._delivered_upto)  # never drop what was not delivered
            before = len(self._items)
            while self._items and self._items[0][0] <= after:
                self._items.popleft()
            self._acknowledged += before - len(self._items)
            if not await self._wait(lambda: bool(self._items), timeout):
                return []
            out = list(itertools.islice(self._items, max_batches))
            self._redelivered += sum(1 for number, _ in out if number <= self._delivered_upto)
            if out[-1][0] > self._delivered_upto:
                self._delivered_upto = out[-1][0]
                self._changed.notify_all()  # room for writers
            return out

    async def stats(self) -> dict[str, int]:
        return {
            "queued_batches": len(self._items),
            "capacity": self._capacity,
            "accepted_batches": self._accepted,
            "taken_batches": self._delivered_upto,
            "acknowledged_batches": self._acknowledged,
            "redelivered_batches": self._redelivered,
            "duplicate_writes": self._duplicates,
            "write_timeouts": self._timeouts,
        }


class MemoryRolloutWriter:
    """A rollout worker's end: each instance is one writer with its own batch numbering."""

    def __init__(self, queue: Any, *, description: str):
        self._queue = queue
        self._description = description
        self._id = uuid.uuid4().hex
        self._seq = 0
        # A batch whose write failed without an answer, and the number it was sent with: the
        # queue may hold it, so writing it again must reuse that number.
        self._unsure: tuple[bytes, int] | None = None
        self._lock = threading.Lock()

    def write_batch(self, batch: RolloutBatch, *, timeout: float | None = None) -> None:
        """Store ``batch``; wait while the queue is full, up to ``timeout`` seconds (``None``:
        forever), then raise ``TimeoutError`` with the batch not stored. Any other error leaves
        it unknown whether the batch was stored: write the same batch again (it is stored at
        most once)."""
        import ray

        from marin_rl_core import serialize_rollout_batch

        data = serialize_rollout_batch(batch)
        with self._lock:  # keeps this writer's batches in order if shared between threads
            seq = self._seq
            if self._unsure is not None and self._unsure[0] == data:
                seq = self._unsure[1]  # the same batch again: the queue drops a duplicate
            try:
                status = ray.get(self._queue.put.remote(self._id, seq, data, timeout))
            except BaseException:
                self._unsure = (data, seq)
                self._seq = max(self._seq, seq + 1)  # never give this number to another batch
                raise
            if status == "timeout":  # not stored by this call: its number is free again
                raise TimeoutError(
                    f"{self._description} stayed full for {timeout} s, so the batch was not "
                    "stored: the trainer is reading rollouts more slowly than they are written. "
                    "Raise [storage] capacity, lower num_rollout_workers, or pass a longer "
                    "timeout to write_batch."
                )
            self._unsure = None  # "accepted", or "duplicate": the earlier try stored it
            self._seq = max(self._seq, seq + 1)


class MemoryRolloutReader:
    """The trainer's end: every accepted batch is returned by exactly one successful call."""

    def __init__(self, queue: Any, queue_name: str, after: int = 0):
        self._queue = queue
        self._queue_name = queue_name
        self.after = after
        """The number of the last batch this reader has received (0: none yet)."""
        self._asked: tuple[float, float] | None = None  # (since, timeout) of a read in flight

    def position(self) -> dict[str, Any]:
        return {"queue": self._queue_name, "after": self.after}

    def checkpointed(self, position: Any) -> None:
        """Nothing to forget: the queue drops each batch once the next read acknowledges it."""

    def trouble(self) -> str:
        asked = self._asked
        if asked is not None:
            late = time.monotonic() - asked[0] - asked[1]
            if late > 10.0:
                return f"rollout queue actor {self._queue_name!r}: no answer for {late:.0f} s"
        return ""

    def read_batches(self, *, max_batches: int, timeout: float = 0.0) -> list[RolloutBatch]:
        import ray

        from marin_rl_core import deserialize_rollout_batch

        if max_batches < 1:
            return []
        self._asked = (time.monotonic(), max(0.0, timeout))
        try:
            items = ray.get(self._queue.take.remote(self.after, max_batches, max(0.0, timeout)))
        finally:
            self._asked = None
        batches = [deserialize_rollout_batch(data) for _, data in items]
        if items:  # only now received: the next read acknowledges them
            self.after = items[-1][0]
        return batches


class MemoryRolloutStorage:
    """A handle on the job's queue actor; picklable, so it can be sent to Ray workers."""

    def __init__(self, config: MemoryStorageConfig):
        self.config = config
        self.queue_name = config.queue_name or f"marinrl-rollouts-{uuid.uuid4().hex[:16]}"
        self._queue: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "queue_name": self.queue_name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self.queue_name = state["queue_name"]
        self._queue = None

    @property
    def _description(self) -> str:
        return (
            f"memory rollout storage queue {self.queue_name!r} "
            f"(capacity {self.config.capacity} batches)"
        )

    def _queue_actor(self) -> Any:
        if self._queue is None:
            import ray

            actor_class = ray.remote(RolloutQueue)
            # get_if_exists makes concurrent first uses from several processes agree on one actor.
            self._queue = actor_class.options(
                name=self.queue_name,
                namespace=self.config.namespace,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                max_restarts=0,
            ).remote(self.config.capacity)
        return self._queue

    def writer(self, *, name: str = "") -> MemoryRolloutWriter:
        return MemoryRolloutWriter(self._queue_actor(), description=self._description)

    def reader(self, position: Any = None) -> MemoryRolloutReader:
        """The queue's reader; ``position`` goes on after the batch it names when it is of this
        queue (a reader of the same job started again), and is ignored otherwise: the queue of
        an earlier job is gone with its batches, which that job's checkpoint holds."""
        after = 0
        if isinstance(position, dict) and position.get("queue") == self.queue_name:
            after = int(position.get("after", 0))
        return MemoryRolloutReader(self._queue_actor(), self.queue_name, after)

    def stats(self) -> dict[str, int]:
        """Counters of the queue: queued, accepted and taken batches, write timeouts."""
        import ray

        return ray.get(self._queue_actor().stats.remote())

    def close(self) -> None:
        """Remove the queue actor and whatever it still holds (call once, at job end)."""
        import ray

        if not ray.is_initialized():
            return  # the cluster, and the queue with it, is already gone
        try:
            actor = ray.get_actor(self.queue_name, namespace=self.config.namespace)
        except ValueError:
            return
        ray.kill(actor)
        self._queue = None


def build_memory_storage(config: MemoryStorageConfig, run: RunInfo) -> MemoryRolloutStorage:
    return MemoryRolloutStorage(config)


@hookimpl
def marinrl_register_storages():
    yield StoragePlugin(
        name="memory",
        summary="Bounded in-memory queue held by a Ray actor, with back-pressure (one job).",
        config_class=MemoryStorageConfig,
        build=build_memory_storage,
    )
