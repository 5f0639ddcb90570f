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
import math
import socket
import threading
import time
from typing import Any

import attrs

from marin_rl_core import WeightTransferPlugin, hookimpl

WIRE_FORMAT_VERSION = 1
_INFO_ACTION = "info"
_LATEST_TICKET = b"latest"
_META_KEY = b"marinrl.weights"


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
    port: int = attrs.field(default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
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


def _array_leaves(model: Any) -> tuple[list[Any], Any, list[int], list[str]]:
    """Flatten ``model``: (all leaves, treedef, indices of the array leaves, their paths)."""
    import equinox as eqx
    import jax

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(model)
    leaves = [leaf for _, leaf in with_paths]
    index = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]
    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in index]
    return leaves, treedef, index, paths


@attrs.frozen
class _Snapshot:
    weight_step: int
    schema: Any  # pa.Schema with the JSON description in its metadata
    batches: list[Any]  # pa.RecordBatch, referencing the host copies of the leaves
    nbytes: int


def _host_copy(leaf: Any) -> Any:
    """A host numpy array that nothing else writes to (the trainer may donate ``leaf``)."""
    import jax
    import numpy as np

    if isinstance(leaf, jax.Array) and all(d.platform != "cpu" for d in leaf.devices()):
        return np.ascontiguousarray(jax.device_get(leaf))  # the transfer is already a copy
    # numpy leaves, and CPU jax arrays (whose numpy view shares the device buffer).
    return np.array(leaf, copy=True, order="C")


def _snapshot(model: Any, weight_step: int, chunk_bytes: int) -> _Snapshot:
    import numpy as np
    import pyarrow as pa

    leaves, _, index, paths = _array_leaves(model)
    arrays = [_host_copy(leaves[i]) for i in index]
    description = {
        "format_version": WIRE_FORMAT_VERSION,
        "weight_step": weight_step,
        "leaves": [
            {"path": p, "dtype": str(a.dtype), "shape": list(a.shape)}
            for p, a in zip(paths, arrays, strict=True)
        ],
    }
    schema = pa.schema(
        [("leaf", pa.int32()), ("offset", pa.int64()), ("data", pa.large_binary())],
        metadata={_META_KEY: json.dumps(description).encode()},
    )

    batches: list[Any] = []
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
        pending, pending_bytes = [], 0

    for i, array in enumerate(arrays):
        buffer = pa.py_buffer(array.reshape(-1).view(np.uint8))
        for start in range(0, max(buffer.size, 1), chunk_bytes):
            piece = buffer.slice(start, min(chunk_bytes, buffer.size - start))
            if pending_bytes + piece.size > chunk_bytes:
                flush()
            pending.append((i, start, piece))
            pending_bytes += piece.size
    flush()
    return _Snapshot(
        weight_step=weight_step,
        schema=schema,
        batches=batches,
        nbytes=sum(a.nbytes for a in arrays),
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
            if ticket.ticket != _LATEST_TICKET:
                raise flight.FlightServerError(f"unknown ticket {ticket.ticket!r}")
            with self.lock:
                snap = self.snapshot
                if snap is None:
                    raise flight.FlightUnavailableError("no weights have been published yet")
                self.counters["fetches_served"] += 1
                self.counters["bytes_sent"] += snap.nbytes
            reader = pa.RecordBatchReader.from_batches(snap.schema, snap.batches)
            return flight.RecordBatchStream(reader)

    return _WeightsFlightServer


class ArrowFlightServer:
    """The trainer's end: a Flight server holding the latest published weights."""

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

    @property
    def address(self) -> str:
        return self._address

    def publish(self, model: Any, *, weight_step: int) -> None:
        """Serve ``model``'s array leaves as ``weight_step`` from now on (copied to host memory,
        so the caller may donate or change ``model`` afterwards). Steps must increase."""
        start = time.perf_counter()
        with self._server.lock:
            current = self._server.snapshot
        if current is not None and weight_step <= current.weight_step:
            raise ValueError(
                f"weight_step must increase with each publish: got {weight_step} after "
                f"{current.weight_step}"
            )
        snapshot = _snapshot(model, int(weight_step), self._config.chunk_bytes)
        with self._server.lock:
            self._server.snapshot = snapshot
        self._publishes += 1
        self._publish_seconds += time.perf_counter() - start

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
        self._server.shutdown()


# --- client ------------------------------------------------------------------------------------


class WeightMismatchError(ValueError):
    """The served weights do not have ``like_model``'s leaves (paths, dtypes or shapes)."""


class ArrowFlightClient:
    """A rollout worker's end: downloads the server's weights when they are newer."""

    def __init__(self, address: str, config: ArrowFlightConfig):
        import pyarrow.flight as flight

        self._address = address
        self._client = flight.connect(address)
        self._options = flight.FlightCallOptions(timeout=config.timeout_s)
        self._last_step: int | None = None
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

    def receive(self, like_model: Any) -> tuple[Any, int] | None:
        """``(model, weight_step)``: ``like_model`` with the server's newer weights (each array
        leaf on the device/sharding of ``like_model``'s leaf), or ``None`` when the server has
        nothing newer than the last weights this client received."""
        step = self._server_step()
        if step is None or (self._last_step is not None and step <= self._last_step):
            return None
        start = time.perf_counter()
        model, got_step, nbytes = self._download(like_model)
        elapsed = time.perf_counter() - start
        self._last_step = got_step
        self._metrics["fetches"] += 1
        self._metrics["bytes_received"] += nbytes
        self._metrics["fetch_seconds"] += elapsed
        self._metrics["last_fetch_seconds"] = elapsed
        return model, got_step

    def _download(self, like_model: Any) -> tuple[Any, int, int]:
        import jax
        import numpy as np
        import pyarrow.flight as flight

        leaves, treedef, index, paths = _array_leaves(like_model)
        reader = self._client.do_get(flight.Ticket(_LATEST_TICKET), options=self._options)
        description = self._description(reader.schema)
        self._check_fits(description, [leaves[i] for i in index], paths)
        step = description["weight_step"]

        like = [leaves[i] for i in index]
        buffers = [
            np.empty(math.prod(x.shape) * np.dtype(x.dtype).itemsize, np.uint8) for x in like
        ]
        filled = [0] * len(like)
        for chunk in reader:
            batch = chunk.data
            leaf_ids = batch.column(0).to_numpy()
            offsets = batch.column(1).to_numpy()
            data = batch.column(2)
            for row in range(batch.num_rows):
                leaf, offset = int(leaf_ids[row]), int(offsets[row])
                piece = np.frombuffer(data[row].as_buffer(), dtype=np.uint8)
                if not (0 <= leaf < len(like) and 0 <= offset <= buffers[leaf].size - piece.size):
                    raise ConnectionError(
                        f"weight server at {self._address} sent bytes outside leaf {leaf}"
                    )
                buffers[leaf][offset : offset + piece.size] = piece
                filled[leaf] += piece.size
        short = [paths[i] for i in range(len(like)) if filled[i] != buffers[i].size]
        if short:
            raise ConnectionError(
                f"incomplete weights from {self._address} (step {step}): leaves {short[:5]} "
                "did not receive all their bytes"
            )

        new_leaves = list(leaves)
        for k, (i, old) in enumerate(zip(index, like, strict=True)):
            value = buffers[k].view(old.dtype).reshape(old.shape)
            if isinstance(old, jax.Array):
                value = jax.device_put(value, old.sharding)
            new_leaves[i] = value
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

    def _check_fits(self, description: dict[str, Any], like: list[Any], paths: list[str]) -> None:
        served = description["leaves"]
        mine = [
            {"path": p, "dtype": str(x.dtype), "shape": list(x.shape)}
            for p, x in zip(paths, like, strict=True)
        ]
        if served == mine:
            return
        if len(served) != len(mine):
            detail = f"the server has {len(served)} array leaves, like_model has {len(mine)}"
        else:
            k = next(k for k in range(len(mine)) if served[k] != mine[k])
            s, m = served[k], mine[k]
            detail = (
                f"leaf {k} is {s.get('path')} {s.get('dtype')}{s.get('shape')} on the server but "
                f"{m['path']} {m['dtype']}{m['shape']} in like_model"
            )
        raise WeightMismatchError(
            f"weights from {self._address} (step {description['weight_step']}) do not fit "
            f"like_model: {detail}. Build like_model with the trainer's model config."
        )

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
