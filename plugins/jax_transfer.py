"""The ``jax`` weight transfer: rollout workers pull the trainer's arrays with
``jax.experimental.transfer``, device to device, then place them in their own shardings.

The trainer process runs two servers, both on ``host`` (127.0.0.1 unless configured):

- a JAX transfer server, which hands out the arrays of a published version to one pull each;
- a small HTTP control endpoint (the address clients are given): ``GET /latest`` answers the
  newest published step; ``POST /pull`` offers the arrays of the newest version to one pull
  and answers its id, step and leaf description (path, dtype, shape of each array).

A client asks ``/latest``; when the step is newer than its own it asks ``/pull``, checks the
description against its ``like_model`` leaf by leaf (nothing is built from what the server
says), and pulls the offered arrays into ``like_model``'s shardings. An offer is one version's
arrays, so a client gets all of a version or an error, whatever is published meanwhile.

``publish`` keeps the (already copied, see the protocol) arrays and returns: nothing is
prepared, the arrays are read when a client pulls them. A pull cannot be cancelled and is not
bounded by jax's own timeout when the offer is gone, so the client bounds it from outside
(``timeout_s``); an offer nobody pulls is dropped after ``offer_timeout_s``.

Neither endpoint authenticates: on a cluster address anyone on that network can read the
weights. Facts checked on CPU (jax 0.10.2): the transfer server must be started with explicit
transport addresses (the defaults abort the process); a pull needs the same layout on both ends
(an array in 4 shards pulled into one device, or into a replicated one, fails), so the trainer
offers each leaf whole on its first device (the model in the inference dtype must fit one
device) and a worker pulls onto its first device and places the leaves from there.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
PROTOCOL_VERSION = 1


@attrs.frozen(kw_only=True)
class JaxTransferConfig:
    """Config of the ``jax`` weight transfer.

    Args:
        host: the interface both trainer endpoints (control and transfer) and each client's
            transfer endpoint bind to; ``0.0.0.0`` when rollout workers run on other machines.
        port: the control endpoint's port; 0 picks a free one.
        advertise_host: the host name put in the addresses clients are given; empty means
            ``host``, or this machine's IP address when ``host`` is a wildcard.
        timeout_s: the longest one receive may take (asking and pulling) before it fails.
        offer_timeout_s: how long the arrays offered to a client that asked stay held for it.
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    advertise_host: str = ""
    timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0.0))
    offer_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0.0))


def _advertised(config: JaxTransferConfig) -> str:
    host = config.advertise_host or config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _start_transfer_server(host: str) -> Any:
    import jax
    from jax.experimental import transfer

    backend = jax.devices()[0].client
    return transfer.start_transfer_server(backend, f"{host}:0", [f"{host}:0"])


# --- server ------------------------------------------------------------------------------------


class JaxTransferServer:
    """The trainer's end: the newest published arrays, offered to clients on request."""

    def __init__(self, config: JaxTransferConfig):
        self._config = config
        self._lock = threading.Lock()
        self._step: int | None = None
        self._arrays: list[Any] = []
        self._leaves: list[dict[str, Any]] = []
        self._transfer: Any = None
        self._transfer_address = ""
        self.counters = {"publishes": 0, "offers": 0, "latest_calls": 0, "bytes_offered": 0}
        self._http = ThreadingHTTPServer((config.host, config.port), self._handler_class())
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="marinrl-jax-transfer", daemon=True
        )
        self._thread.start()
        self._address = f"http://{_advertised(config)}:{self._http.server_address[1]}"

    @property
    def address(self) -> str:
        return self._address

    def publish(self, model: Any, *, weight_step: int) -> None:
        """Offer ``model``'s arrays (the server's own, see the protocol) as ``weight_step``
        from now on; returns at once. Steps must increase."""
        import jax

        step = int(weight_step)
        leaves, _, index, paths = array_leaves(model)
        # jax's transfer needs one layout on both ends: each leaf is offered whole on this
        # process's first device (a device-to-device gather, dispatched asynchronously; the
        # host arrays a trainer over several hosts gathers are put there).
        whole = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        arrays = [
            leaves[i]
            if getattr(leaves[i], "sharding", None) == whole
            else jax.device_put(leaves[i], whole)
            for i in index
        ]
        if self._transfer is None:
            self._transfer = _start_transfer_server(self._config.host)
            port = self._transfer.address().rsplit(":", 1)[1]
            self._transfer_address = f"{_advertised(self._config)}:{port}"
        with self._lock:
            if self._step is not None and step <= self._step:
                raise ValueError(
                    f"weight_step must increase with each publish: got {step} after {self._step}"
                )
            self._step, self._arrays, self._leaves = step, arrays, describe_leaves(arrays, paths)
            self.counters["publishes"] += 1

    def _latest(self) -> dict[str, Any]:
        with self._lock:
            self.counters["latest_calls"] += 1
            return {"protocol": PROTOCOL_VERSION, "weight_step": self._step}

    def _offer(self) -> dict[str, Any]:
        with self._lock:
            if self._step is None:
                return {"protocol": PROTOCOL_VERSION, "weight_step": None}
            step, arrays, leaves = self._step, self._arrays, self._leaves
            self.counters["offers"] += 1
            self.counters["bytes_offered"] += sum(int(a.nbytes) for a in arrays)
        uuid = secrets.randbits(62)
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self._config.offer_timeout_s)
        self._transfer.await_pull(uuid, arrays, timeout=expires)
        return {
            "protocol": PROTOCOL_VERSION,
            "weight_step": step,
            "uuid": uuid,
            "transfer_address": self._transfer_address,
            "leaves": leaves,
        }

    def _handler_class(self) -> type:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: dict[str, Any], status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/latest":
                    self._reply({"error": f"unknown path {self.path}"}, 404)
                    return
                self._reply(server._latest())

            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/pull":
                    self._reply({"error": f"unknown path {self.path}"}, 404)
                    return
                try:
                    self._reply(server._offer())
                except Exception as exc:  # noqa: BLE001 - the client gets the reason
                    logger.exception("offering weights failed")
                    self._reply({"error": f"{type(exc).__name__}: {exc}"}, 500)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("jax transfer control: " + format, *args)

        return Handler

    def get_metrics(self) -> dict[str, float]:
        """Counters: publishes, offers made, latest calls, bytes offered."""
        with self._lock:
            return {f"weight_transfer/server/{k}": float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


# --- client ------------------------------------------------------------------------------------


class JaxTransferClient:
    """A rollout worker's end: pulls the newest version's arrays when it is newer."""

    def __init__(self, address: str, config: JaxTransferConfig):
        self._address = address.rstrip("/")
        self._config = config
        self._last_step: int | None = None
        self._transfer: Any = None
        self._connections: dict[str, Any] = {}

    def _call(self, method: str, path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"{self._address}{path}", method=method, data=b"")
        timeout = min(30.0, self._config.timeout_s)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise ConnectionError(
                f"the jax weight server at {self._address} answered {exc.code} to {path}: "
                f"{exc.read()[:300]!r}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectionError(
                f"the jax weight server at {self._address} did not answer {path}: {exc}"
            ) from None
        except ValueError as exc:
            raise ConnectionError(f"{self._address}{path} sent no JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("protocol") != PROTOCOL_VERSION:
            raise ConnectionError(
                f"{self._address} is not a marinrl jax weight server of protocol "
                f"{PROTOCOL_VERSION} (it answered {str(body)[:200]}): run the trainer and "
                "rollout workers with one marinrl"
            )
        step = body.get("weight_step")
        if step is not None and not isinstance(step, int):
            raise ConnectionError(f"{self._address} sent a malformed weight_step {step!r}")
        return body

    def _connection(self, transfer_address: str) -> Any:
        if self._transfer is None:
            self._transfer = _start_transfer_server(self._config.host)
        if transfer_address not in self._connections:
            self._connections[transfer_address] = self._transfer.connect(transfer_address)
        return self._connections[transfer_address]

    def receive(self, like_model: Any) -> ReceivedWeights | None:
        """``like_model`` with the newest published arrays, pulled into the shardings of
        ``like_model``'s leaves, or ``None`` when there is nothing newer than the last weights
        received.

        Raises:
            ConnectionError: the server does not answer or answers nonsense.
            TimeoutError: the whole receive took longer than ``timeout_s``.
            WeightMismatchError: the offered arrays do not fit ``like_model``.
        """
        import jax

        start = time.perf_counter()
        latest = self._call("GET", "/latest")["weight_step"]
        if latest is None or (self._last_step is not None and latest <= self._last_step):
            return None
        offer = self._call("POST", "/pull")
        step = offer.get("weight_step")
        if not isinstance(step, int):
            return None
        leaves, treedef, index, paths = array_leaves(like_model)
        like = [leaves[i] for i in index]
        check_fits(offer.get("leaves"), like, paths, source=self._address, step=step)
        # Pulled whole onto this process's first device (the layout the server offers), then
        # placed in each leaf's own sharding, device to device.
        whole = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole) for x in like]
        arrays = self._bounded_pull(offer, avals, step, deadline=start + self._config.timeout_s)
        new_leaves = list(leaves)
        for k, (i, old) in enumerate(zip(index, like, strict=True)):
            placed = isinstance(old, jax.Array) and old.sharding != whole
            new_leaves[i] = jax.device_put(arrays[k], old.sharding) if placed else arrays[k]
        elapsed = time.perf_counter() - start
        nbytes = sum(int(a.nbytes) for a in arrays)
        self._last_step = step
        return ReceivedWeights(
            model=jax.tree_util.tree_unflatten(treedef, new_leaves),
            weight_step=step,
            nbytes=nbytes,
            seconds=elapsed,
            latest_step=max(step, latest),
        )

    def _bounded_pull(self, offer: dict[str, Any], avals: list[Any], step: int, *, deadline: float):
        """Pull the offer in a helper thread and wait until ``deadline``: jax's pull cannot be
        cancelled and, for an offer that is gone, returns only when the server exits."""
        import jax

        if not isinstance(offer.get("uuid"), int) or not isinstance(
            offer.get("transfer_address"), str
        ):
            raise ConnectionError(f"{self._address} sent a malformed offer")
        connection = self._connection(offer["transfer_address"])
        result: dict[str, Any] = {}

        def pull() -> None:
            try:
                result["arrays"] = jax.block_until_ready(connection.pull(offer["uuid"], avals))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                result["error"] = exc

        worker = threading.Thread(target=pull, name="marinrl-jax-pull", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.perf_counter()))
        if worker.is_alive():
            raise TimeoutError(
                f"pulling the weights of step {step} from {offer['transfer_address']} did not "
                f"finish within {self._config.timeout_s:g} s (weight_transfer.timeout_s)"
            )
        if "error" in result:
            exc = result["error"]
            raise ConnectionError(
                f"pulling the weights of step {step} from {offer['transfer_address']} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return result["arrays"]

    def close(self) -> None:
        self._connections.clear()


@attrs.frozen
class JaxWeightTransfer:
    """The plugin object: only the config, so it pickles to any worker process. (Each
    receive's bytes, seconds and lag come back in its ``ReceivedWeights``.)"""

    config: JaxTransferConfig

    def server(self) -> JaxTransferServer:
        return JaxTransferServer(self.config)

    def client(self, address: str) -> JaxTransferClient:
        return JaxTransferClient(address, self.config)


@hookimpl
def marinrl_register_weight_transfers():
    yield WeightTransferPlugin(
        name="jax",
        summary="Workers pull the trainer's arrays with jax.experimental.transfer, device to "
        "device, into their own shardings.",
        config_class=JaxTransferConfig,
        build=JaxWeightTransfer,
    )
