"""The ``arrow_flight`` weight transfer: the trainer serves its latest weights over Arrow Flight.

The trainer calls ``server()`` once; it starts a Flight server in the trainer process (on
127.0.0.1 unless configured) and ``publish(model, weight_step=...)`` replaces the weights it
serves. Each rollout worker calls ``client(server.address)`` and then ``receive(like_model)``
whenever it wants fresh weights: the client first asks the server, with a cheap ``info`` action,
which weight step it holds, and downloads only when that step is newer than the last one it
received.

Wire format: the model's array leaves (``jax.tree_util`` flattening, non-array leaves stay
where they are) travel as raw bytes in Arrow record batches with columns ``leaf int32, offset
int64, data large_binary``; a leaf bigger than ``chunk_bytes`` is split over several rows. The
stream's schema metadata holds a JSON description (``weight_step``, and each leaf's path, dtype
and shape). The client checks that description against ``like_model`` (same paths, dtypes and
shapes) and reinterprets the bytes with ``like_model``'s own dtypes, so bfloat16 and float32
values arrive bit for bit and nothing sent over the network is unpickled or used to construct
a type.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from typing import Any

import attrs

from marin_rl_core import (
    ReceivedWeights,
    WeightTransferPlugin,
    array_leaves,
    check_fits,
    describe_leaves,
    hookimpl,
)

logger = logging.getLogger(__name__)

WIRE_FORMAT_VERSION = 2
_INFO_ACTION = "info"
_META_KEY = b"marinrl.weights"
SMALL_PIECE = 1 << 20
"""Leaves smaller than this are copied together into shared record batches."""


@attrs.frozen(kw_only=True)
class ArrowFlightConfig:
    """Config of the ``arrow_flight`` weight transfer.

    Args:
        host: the interface the trainer's Flight server binds to; ``0.0.0.0`` for every
            interface (needed when rollout workers run on other machines).
        port: the server's port; 0 picks a free one.
        advertise_host: the host name put in the server's address; empty means ``host``, or
            this machine's IP address when ``host`` is a wildcard.
        chunk_bytes: the largest record batch the server sends; bigger leaves are split.
        timeout_s: the longest a client waits for one call (info or download).
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    advertise_host: str = ""
    chunk_bytes: int = attrs.field(default=32 * 2**20, validator=attrs.validators.ge(1))
    timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0.0))

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"arrow_flight port must be in [0, 65535], got {self.port}")
        if self.chunk_bytes < 1:
            raise ValueError(f"arrow_flight chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"arrow_flight timeout_s must be > 0, got {self.timeout_s}")


# --- the model <-> leaves conversion ---------------------------------------------------------


@attrs.frozen
class _Snapshot:
    weight_step: int
    schema: Any  # pa.Schema with the JSON description in its metadata
    batches: list[Any]  # pa.RecordBatch, referencing the host copies of the leaves
    nbytes: int
    arrays: list[Any]  # the host views of the leaves (compared with the next version's)
    changed_at: list[int]  # per leaf, the served step at which its bytes last changed
    batch_leaves: list[list[int]]  # per record batch, the leaves it carries

    def batches_for(self, have: int | None) -> tuple[list[Any], int]:
        """The record batches a client holding served step ``have`` lacks (all for ``None``)
        and their bytes: a leaf unchanged since ``have`` is not sent again."""
        if have is None or have >= self.weight_step:
            return self.batches, self.nbytes
        leaves = {i for i, step in enumerate(self.changed_at) if step > have}
        chosen = [
            (batch, ids)
            for batch, ids in zip(self.batches, self.batch_leaves, strict=True)
            if leaves.intersection(ids)
        ]
        sent = {i for _, ids in chosen for i in ids}
        return [b for b, _ in chosen], sum(self.arrays[i].nbytes for i in sent)


def _host_view(leaf: Any) -> Any:
    """``leaf`` as a C-contiguous host numpy array: a view of a CPU buffer (the published model
    is the server's own, so nothing writes to it or frees it), a copy of an accelerator's."""
    import jax
    import numpy as np

    if isinstance(leaf, jax.Array) and all(d.platform != "cpu" for d in leaf.devices()):
        return np.ascontiguousarray(jax.device_get(leaf))
    return np.ascontiguousarray(np.asarray(leaf))


def _unchanged(old: Any, new: Any) -> bool:
    import numpy as np

    if old.dtype != new.dtype or old.shape != new.shape:
        return False
    a, b = old.reshape(-1).view(np.uint8), new.reshape(-1).view(np.uint8)
    # After a train step nearly every leaf differs in its first bytes: look there first, so a
    # changed leaf is not read whole on every publish.
    head = min(a.size, 4096)
    return np.array_equal(a[:head], b[:head]) and np.array_equal(a[head:], b[head:])


def _snapshot(
    model: Any, weight_step: int, chunk_bytes: int, previous: _Snapshot | None = None
) -> _Snapshot:
    import numpy as np
    import pyarrow as pa

    leaves, _, index, paths = array_leaves(model)
    arrays = [_host_view(leaves[i]) for i in index]
    # A leaf whose bytes equal the previous served version's keeps that version's stamp: a
    # client holding it (or any later one) is not sent the leaf again.
    changed_at = [
        previous.changed_at[k]
        if previous is not None
        and len(previous.arrays) == len(arrays)
        and _unchanged(previous.arrays[k], a)
        else weight_step
        for k, a in enumerate(arrays)
    ]
    description = {
        "format_version": WIRE_FORMAT_VERSION,
        "weight_step": weight_step,
        "leaves": describe_leaves(arrays, paths),
        "changed_at": changed_at,
    }
    schema = pa.schema(
        [("leaf", pa.int32()), ("offset", pa.int64()), ("data", pa.large_binary())],
        metadata={_META_KEY: json.dumps(description).encode()},
    )

    batches: list[Any] = []
    batch_leaves: list[list[int]] = []
    pending: list[tuple[int, int, Any]] = []  # (leaf, offset, pa.Buffer slice)
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        if len(pending) == 1:
            data = pending[0][2]  # one slice of one leaf: send its bytes without a copy
        else:
            data = pa.py_buffer(b"".join(p[2].to_pybytes() for p in pending))
        lengths = np.asarray([p[2].size for p in pending], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        column = pa.Array.from_buffers(
            pa.large_binary(), len(pending), [None, pa.py_buffer(offsets), data]
        )
        batches.append(
            pa.RecordBatch.from_arrays(
                [
                    pa.array([p[0] for p in pending], pa.int32()),
                    pa.array([p[1] for p in pending], pa.int64()),
                    column,
                ],
                schema=schema,
            )
        )
        batch_leaves.append(sorted({p[0] for p in pending}))
        pending, pending_bytes = [], 0

    # Leaves under SMALL_PIECE bytes share record batches (their bytes copied together); each
    # piece of a bigger leaf goes alone, as a view of the leaf's buffer (no copy of the
    # weights, and a leaf that did not change is left out whole).
    small = min(SMALL_PIECE, chunk_bytes)
    for i, array in enumerate(arrays):
        buffer = pa.py_buffer(array.reshape(-1).view(np.uint8))
        alone = buffer.size >= small
        for start in range(0, max(buffer.size, 1), chunk_bytes):
            piece = buffer.slice(start, min(chunk_bytes, buffer.size - start))
            if alone or pending_bytes + piece.size > chunk_bytes:
                flush()
            pending.append((i, start, piece))
            pending_bytes += piece.size
            if alone:
                flush()
    flush()
    return _Snapshot(
        weight_step=weight_step,
        schema=schema,
        batches=batches,
        nbytes=sum(a.nbytes for a in arrays),
        arrays=arrays,
        changed_at=changed_at,
        batch_leaves=batch_leaves,
    )


# --- server ------------------------------------------------------------------------------------


def _flight_server_class() -> type:
    """The Flight service, defined on first use so importing this module needs no pyarrow."""
    import pyarrow as pa
    import pyarrow.flight as flight

    class _WeightsFlightServer(flight.FlightServerBase):
        def __init__(self, location: str):
            super().__init__(location)
            self.lock = threading.Lock()
            self.snapshot: _Snapshot | None = None
            self.counters = {"info_calls": 0, "fetches_served": 0, "bytes_sent": 0}

        def list_actions(self, context: Any) -> list[tuple[str, str]]:
            return [(_INFO_ACTION, "JSON: the weight step held (null before the first publish)")]

        def do_action(self, context: Any, action: Any) -> Any:
            if action.type != _INFO_ACTION:
                raise flight.FlightServerError(f"unknown action {action.type!r}")
            with self.lock:
                snap = self.snapshot
                self.counters["info_calls"] += 1
            info = {
                "format_version": WIRE_FORMAT_VERSION,
                "weight_step": None if snap is None else snap.weight_step,
                "nbytes": 0 if snap is None else snap.nbytes,
            }
            yield flight.Result(json.dumps(info).encode())

        def do_get(self, context: Any, ticket: Any) -> Any:
            # The ticket: {"have": the served step the client holds, or null}.
            try:
                have = json.loads(ticket.ticket)["have"]
                if have is not None and not isinstance(have, int):
                    raise TypeError(type(have).__name__)
            except (ValueError, KeyError, TypeError):
                raise flight.FlightServerError(f"unknown ticket {ticket.ticket[:100]!r}") from None
            with self.lock:
                snap = self.snapshot
                if snap is None:
                    raise flight.FlightUnavailableError("no weights have been published yet")
                batches, nbytes = snap.batches_for(have)
                self.counters["fetches_served"] += 1
                self.counters["bytes_sent"] += nbytes
            reader = pa.RecordBatchReader.from_batches(snap.schema, batches)
            return flight.RecordBatchStream(reader)

    return _WeightsFlightServer


class ArrowFlightServer:
    """The trainer's end: a Flight server holding the latest published weights.

    ``publish`` only queues the model: a background thread turns it into Arrow record batches
    (views of the model's host buffers, no copy on CPU) and swaps them in whole, so a stream
    already started keeps the version it started with and the trainer never waits."""

    def __init__(self, config: ArrowFlightConfig):
        self._config = config
        self._server = _flight_server_class()(f"grpc+tcp://{config.host}:{config.port}")
        host = config.advertise_host or config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self._address = f"grpc+tcp://{host}:{self._server.port}"
        self._publish_seconds = 0.0
        self._publishes = 0
        self._queued_step: int | None = None
        self._pending: tuple[Any, int] | None = None
        self._failure: str = ""
        self._closed = False
        self._wake = threading.Condition()
        self._worker = threading.Thread(
            target=self._prepare_loop, name="marinrl-flight-publish", daemon=True
        )
        self._worker.start()

    @property
    def address(self) -> str:
        return self._address

    def publish(self, model: Any, *, weight_step: int) -> None:
        """Serve ``model`` (the server's own from now on: see
        :meth:`~marin_rl_core.protocols.WeightTransferServer.publish`) as ``weight_step`` once
        it is prepared in the background; returns at once. Steps must increase.

        Raises:
            ValueError: ``weight_step`` is not above the last one published.
            RuntimeError: preparing an earlier version failed (the message says why).
        """
        step = int(weight_step)
        with self._wake:
            if self._failure:
                raise RuntimeError(self._failure)
            if self._queued_step is not None and step <= self._queued_step:
                raise ValueError(
                    f"weight_step must increase with each publish: got {step} after "
                    f"{self._queued_step}"
                )
            self._queued_step = step
            self._pending = (model, step)  # a newer one replaces one not yet started
            self._wake.notify()

    def _prepare_loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                assert self._pending is not None
                (model, step), self._pending = self._pending, None
            start = time.perf_counter()
            with self._server.lock:
                previous = self._server.snapshot
            try:
                snapshot = _snapshot(model, step, self._config.chunk_bytes, previous)
            except Exception as exc:  # noqa: BLE001 - reported by the next publish
                logger.exception("preparing weights of step %d to serve failed", step)
                with self._wake:
                    self._failure = f"preparing the weights of step {step} failed: {exc!r}"
                continue
            del model, previous
            with self._server.lock:
                self._server.snapshot = snapshot
            self._publishes += 1
            self._publish_seconds += time.perf_counter() - start

    def served_step(self) -> int | None:
        """The step being served now (``None`` before the first is ready)."""
        with self._server.lock:
            return None if self._server.snapshot is None else self._server.snapshot.weight_step

    def get_metrics(self) -> dict[str, float]:
        """Counters: publishes, publish seconds, info calls, fetches served, bytes sent."""
        with self._server.lock:
            counters = dict(self._server.counters)
            step = self._server.snapshot.weight_step if self._server.snapshot else -1
        return {
            **{f"weight_transfer/server/{k}": float(v) for k, v in counters.items()},
            "weight_transfer/server/publishes": float(self._publishes),
            "weight_transfer/server/publish_seconds": self._publish_seconds,
            "weight_transfer/server/weight_step": float(step),
        }

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._server.shutdown()


# --- client ------------------------------------------------------------------------------------


class ArrowFlightClient:
    """A rollout worker's end: downloads the server's weights when they are newer."""

    def __init__(self, address: str, config: ArrowFlightConfig):
        import pyarrow.flight as flight

        self._address = address
        self._client = flight.connect(address)
        self._options = flight.FlightCallOptions(timeout=config.timeout_s)
        self._last_step: int | None = None
        self._held: list[Any] | None = None
        """The array leaves of the last weights received: a leaf the server reports unchanged
        since then is not sent again and is taken from here."""
        self._metrics = {
            "info_calls": 0.0,
            "fetches": 0.0,
            "bytes_received": 0.0,
            "fetch_seconds": 0.0,
            "last_fetch_seconds": 0.0,
        }

    def _server_step(self) -> int | None:
        import pyarrow.flight as flight

        action = flight.Action(_INFO_ACTION, b"")
        results = list(self._client.do_action(action, options=self._options))
        self._metrics["info_calls"] += 1
        try:
            info = json.loads(results[0].body.to_pybytes())
            version, step = info["format_version"], info["weight_step"]
        except (IndexError, ValueError, KeyError, TypeError) as exc:
            raise ConnectionError(
                f"{self._address} is not a marinrl arrow_flight weight server: its info reply "
                f"could not be read ({type(exc).__name__}: {exc})"
            ) from exc
        if version != WIRE_FORMAT_VERSION:
            raise ConnectionError(
                f"the weight server at {self._address} speaks wire format {version}, this client "
                f"{WIRE_FORMAT_VERSION}: run the trainer and rollout workers with one marinrl"
            )
        if step is not None and not isinstance(step, int):
            raise ConnectionError(f"weight server sent a malformed weight_step {step!r}")
        return step

    def receive(self, like_model: Any) -> ReceivedWeights | None:
        """``like_model`` with the server's newer weights (each array leaf on the
        device/sharding of ``like_model``'s leaf), or ``None`` when the server has nothing
        newer than the last weights this client received. The stream carries the version
        being served when it starts, whole."""
        import pyarrow.flight as flight

        start = time.perf_counter()
        try:
            step = self._server_step()
            if step is None or (self._last_step is not None and step <= self._last_step):
                return None
            model, got_step, nbytes = self._download(like_model)
        except flight.FlightError as exc:
            raise ConnectionError(
                f"the arrow_flight weight server at {self._address} did not answer: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            ) from exc
        elapsed = time.perf_counter() - start
        self._last_step = got_step
        self._metrics["fetches"] += 1
        self._metrics["bytes_received"] += nbytes
        self._metrics["fetch_seconds"] += elapsed
        self._metrics["last_fetch_seconds"] = elapsed
        return ReceivedWeights(
            model=model,
            weight_step=got_step,
            nbytes=nbytes,
            seconds=elapsed,
            latest_step=max(step, got_step),
        )

    def _download(self, like_model: Any) -> tuple[Any, int, int]:
        import jax
        import numpy as np
        import pyarrow.flight as flight

        leaves, treedef, index, paths = array_leaves(like_model)
        have = self._last_step if self._held is not None and len(self._held) == len(index) else None
        ticket = flight.Ticket(json.dumps({"have": have}).encode())
        reader = self._client.do_get(ticket, options=self._options)
        description = self._description(reader.schema)
        check_fits(
            description["leaves"],
            [leaves[i] for i in index],
            paths,
            source=self._address,
            step=description["weight_step"],
        )
        step = description["weight_step"]

        like = [leaves[i] for i in index]
        sizes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in like]
        # A leaf that arrives in one piece is used where it lies (a view of the received Arrow
        # buffer, which nothing else holds); a leaf split over several pieces is assembled.
        buffers: list[Any] = [None] * len(like)
        filled = [0] * len(like)
        for chunk in reader:
            batch = chunk.data
            leaf_ids = batch.column(0).to_numpy()
            offsets = batch.column(1).to_numpy()
            data = batch.column(2)
            for row in range(batch.num_rows):
                leaf, offset = int(leaf_ids[row]), int(offsets[row])
                piece = np.frombuffer(data[row].as_buffer(), dtype=np.uint8)
                if not (0 <= leaf < len(like) and 0 <= offset <= sizes[leaf] - piece.size):
                    raise ConnectionError(
                        f"weight server at {self._address} sent bytes outside leaf {leaf}"
                    )
                if buffers[leaf] is None and offset == 0 and piece.size == sizes[leaf]:
                    buffers[leaf] = piece
                else:
                    if buffers[leaf] is None or not buffers[leaf].flags.writeable:
                        whole, buffers[leaf] = buffers[leaf], np.empty(sizes[leaf], np.uint8)
                        if whole is not None:
                            buffers[leaf][:] = whole
                    buffers[leaf][offset : offset + piece.size] = piece
                filled[leaf] += piece.size
        # Leaves unchanged since the version this client holds were not sent: kept from it.
        changed_at = description.get("changed_at")
        if not (isinstance(changed_at, list) and len(changed_at) == len(like)):
            raise ConnectionError(f"the weight stream from {self._address} has no changed_at")
        # (A piece of such a leaf may ride along in a record batch shared with changed ones.)
        kept = [
            have is not None and isinstance(at, int) and at <= have and filled[k] != sizes[k]
            for k, at in enumerate(changed_at)
        ]
        short = [paths[i] for i in range(len(like)) if filled[i] != sizes[i] and not kept[i]]
        if short:
            raise ConnectionError(
                f"incomplete weights from {self._address} (step {step}): leaves {short[:5]} "
                "did not receive all their bytes"
            )

        new_leaves = list(leaves)
        for k, (i, old) in enumerate(zip(index, like, strict=True)):
            if kept[k]:
                value = self._held[k]  # type: ignore[index]
            else:
                got = buffers[k] if buffers[k] is not None else np.empty(0, np.uint8)  # 0 bytes
                value = got.view(old.dtype).reshape(old.shape)
            if isinstance(old, jax.Array) and (
                not isinstance(value, jax.Array) or value.sharding != old.sharding
            ):
                value = jax.device_put(value, old.sharding)
            new_leaves[i] = value
        self._held = [new_leaves[i] for i in index]
        return jax.tree_util.tree_unflatten(treedef, new_leaves), step, sum(filled)

    def _description(self, schema: Any) -> dict[str, Any]:
        try:
            description = json.loads((schema.metadata or {})[_META_KEY])
            well_formed = isinstance(description["weight_step"], int) and isinstance(
                description["leaves"], list
            )
        except (KeyError, ValueError, TypeError) as exc:
            well_formed, description = False, exc
        if not well_formed:
            raise ConnectionError(
                f"the weight stream from {self._address} has no readable description "
                f"({description!r:.200})"
            )
        return description

    def get_metrics(self) -> dict[str, float]:
        """Counters: info calls, fetches, bytes received, fetch seconds (total and last)."""
        out = {f"weight_transfer/client/{k}": v for k, v in self._metrics.items()}
        out["weight_transfer/client/weight_step"] = float(
            -1 if self._last_step is None else self._last_step
        )
        return out

    def close(self) -> None:
        self._client.close()


class ArrowFlightWeightTransfer:
    """The plugin object: holds only the config, so it pickles to any worker process."""

    def __init__(self, config: ArrowFlightConfig):
        self.config = config

    def server(self) -> ArrowFlightServer:
        return ArrowFlightServer(self.config)

    def client(self, address: str) -> ArrowFlightClient:
        return ArrowFlightClient(address, self.config)


def build_arrow_flight(config: ArrowFlightConfig) -> ArrowFlightWeightTransfer:
    return ArrowFlightWeightTransfer(config)


@hookimpl
def marinrl_register_weight_transfers():
    yield WeightTransferPlugin(
        name="arrow_flight",
        summary="Trainer serves its latest weights over Arrow Flight; workers pull newer ones.",
        config_class=ArrowFlightConfig,
        build=build_arrow_flight,
    )
