"""The weight transfer plugins (``arrow_flight``), in process and with a client in another
process: bit-exact versions, never a mix of two, a publish that hands the server a copy the
trainer's next step cannot touch, receive metrics, bounded errors.

Run as a script (``python test_weight_transfer.py PLUGIN ADDRESS OUTDIR``) this module is that
other process: it reads ``recv SEED`` lines on stdin, receives weights into a model built from
SEED and answers with one JSON line per command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from marin_rl_plugins import arrow_flight, jax_transfer  # noqa: E402
from marin_rl_plugins.arrow_flight import ArrowFlightConfig  # noqa: E402

from marin_rl_core.errors import WeightMismatchError  # noqa: E402
from marin_rl_core.registry import build_registry  # noqa: E402

PLUGINS = {
    "arrow_flight": (arrow_flight, {"chunk_bytes": 100}),
    "jax": (jax_transfer, {"timeout_s": 60.0}),
}
"""Each plugin's module and a config that makes it work hard (tiny chunks: leaves split over
several record batches)."""


class Policy(eqx.Module):
    """A small mixed-precision model: an MLP with a bfloat16 first layer, haliax layers, and a
    leaf of awkward float values."""

    mlp: eqx.nn.MLP
    embed: hax.nn.Embedding
    head: hax.nn.Linear
    special: jax.Array
    steps: jax.Array
    scale: float = eqx.field(static=True, default=0.5)


def make_model(seed: int) -> Policy:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    mlp = eqx.nn.MLP(4, 3, 16, 2, key=k1)
    mlp = eqx.tree_at(lambda m: m.layers[0].weight, mlp, mlp.layers[0].weight.astype(jnp.bfloat16))
    Vocab, Embed, Out = hax.Axis("vocab", 11), hax.Axis("embed", 6), hax.Axis("out", 5)
    embed = hax.nn.Embedding.init(Vocab, Embed, key=k2)
    embed = eqx.tree_at(lambda e: e.weight.array, embed, embed.weight.array.astype(jnp.bfloat16))
    head = hax.nn.Linear.init(Embed, Out, key=k3)
    special = jnp.asarray([np.nan, -0.0, np.inf, -np.inf, 1e-40, seed], dtype=jnp.bfloat16)
    return Policy(mlp=mlp, embed=embed, head=head, special=special, steps=jnp.arange(3) + seed)


def array_bytes(model) -> list[tuple[str, bytes]]:
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return [(str(x.dtype), np.asarray(x).tobytes()) for x in leaves]


def build_transfer(name: str, **overrides):
    module, config = PLUGINS[name]
    record = build_registry(autoload=False, modules=[module]).get("weight_transfer", name)
    return record.build(record.config_class(**{**config, **overrides}))


@pytest.fixture(params=sorted(PLUGINS))
def plugin(request) -> str:
    return request.param


@pytest.fixture
def transfer(plugin):
    return build_transfer(plugin)


def receive_step(client, like, step: int, *, timeout: float = 30.0):
    """Receive until weights of ``step`` (or newer) arrive: a publish is served once the
    server has prepared it, in the background."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.receive(like)
        if got is not None and got.weight_step >= step:
            return got
        time.sleep(0.01)
    raise AssertionError(f"weights of step {step} did not arrive within {timeout} s")


@pytest.fixture
def server(transfer):
    srv = transfer.server()
    yield srv
    srv.close()


def test_client_gets_each_newer_version_bit_exactly(transfer, server):
    assert "://127.0.0.1:" in server.address  # loopback unless told otherwise
    client = transfer.client(server.address)
    like = make_model(seed=100)
    assert client.receive(like) is None  # nothing published yet

    nbytes = sum(len(b) for _, b in array_bytes(like))
    for step, seed in [(1, 1), (2, 2), (5, 3)]:
        published = make_model(seed)
        server.publish(published, weight_step=step)
        got = receive_step(client, like, step)
        model = got.model
        assert got.weight_step == step
        assert array_bytes(model) == array_bytes(make_model(seed))
        assert got.nbytes == nbytes and got.seconds > 0 and got.latest_step == step
        assert got.metrics()["gb_per_s"] > 0 and got.metrics()["lag_steps"] == 0
        assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(like)
        assert isinstance(model.head.weight.array, jax.Array)
        assert model.head.weight.axes == like.head.weight.axes
        assert client.receive(like) is None  # nothing newer: no download
    client.close()


def test_a_client_that_falls_behind_gets_only_the_latest(transfer, server):
    client = transfer.client(server.address)
    for step in (1, 2, 3):
        server.publish(make_model(step), weight_step=step)
    receive_step(transfer.client(server.address), make_model(0), 3)  # step 3 is served now
    got = client.receive(make_model(0))
    assert got.weight_step == 3 and array_bytes(got.model) == array_bytes(make_model(3))
    assert client.receive(make_model(0)) is None  # the older ones are never sent
    client.close()


def test_what_the_trainer_publishes_is_untouched_by_its_next_donating_step(transfer, server):
    """The trainer hands the server ``publish_copy(model)``: a train step that donates the
    model's buffers (and overwrites them) right after cannot change what is served."""
    from marin_rl_core.models.build import publish_copy

    params = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones(7, jnp.float32)}
    server.publish(publish_copy(params, jnp.bfloat16), weight_step=1)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 - 1, p), donate_argnums=0)
    params = step(params)
    params = step(params)  # the old buffers are reused by now
    like = {"w": jnp.zeros(4096, jnp.bfloat16), "b": jnp.zeros(7, jnp.bfloat16)}
    got = receive_step(transfer.client(server.address), like, 1)
    assert (
        np.asarray(got.model["w"], np.float32).tolist()
        == np.arange(4096).astype(jnp.bfloat16).astype(np.float32).tolist()
    )
    assert got.nbytes == (4096 + 7) * 2  # bf16: half the bytes


def test_clients_never_receive_a_mix_of_two_versions(transfer, server):
    """Versions published in a tight loop while three clients receive: every model received
    is exactly one published version, whole."""
    last = 60

    def version(v: int) -> dict:
        return {"w": jnp.full(5000, v, jnp.float32), "b": jnp.full(300, v, jnp.bfloat16)}

    like = version(0)
    seen: list[list[int]] = [[] for _ in range(3)]
    errors: list[str] = []

    def pull(k: int) -> None:
        client = transfer.client(server.address)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = client.receive(like)
            if got is None:
                continue
            values = {float(v) for leaf in jax.tree.leaves(got.model) for v in np.unique(leaf)}
            if values != {float(got.weight_step)}:
                errors.append(f"client {k}: step {got.weight_step} holds {sorted(values)}")
            seen[k].append(got.weight_step)
            if got.weight_step == last:
                break
        client.close()

    threads = [threading.Thread(target=pull, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for v in range(1, last + 1):
        server.publish(version(v), weight_step=v)
        time.sleep(0.002)
    for t in threads:
        t.join(90)
    assert not errors, errors[:5]
    for k, steps in enumerate(seen):
        assert steps and steps[-1] == last, (k, steps)
        assert steps == sorted(set(steps)), (k, steps)  # each version once, in order


def test_a_dead_server_is_a_prompt_error_naming_it_and_a_new_one_is_received(transfer):
    """A worker's receive from a server that is gone fails at once with the address (the
    worker samples on and retries); the weights the client had are not forgotten."""
    server = transfer.server()
    client = transfer.client(server.address)
    server.publish(make_model(1), weight_step=1)
    receive_step(client, make_model(0), 1)
    server.close()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=server.address.split("://")[1]):
        client.receive(make_model(0))
    assert time.monotonic() - start < 30


def test_weight_steps_must_increase(server):
    # (Checked when publishing, before the server prepares anything.)
    server.publish(make_model(0), weight_step=3)
    with pytest.raises(ValueError, match="must increase"):
        server.publish(make_model(0), weight_step=3)


def test_a_differently_shaped_like_model_is_refused_with_the_leaf(transfer, server):
    server.publish({"a": jnp.zeros((2, 3)), "b": jnp.zeros(4, jnp.bfloat16)}, weight_step=1)
    client = transfer.client(server.address)
    right = {"a": jnp.ones((2, 3)), "b": jnp.ones(4, jnp.bfloat16)}
    assert receive_step(transfer.client(server.address), right, 1).weight_step == 1
    with pytest.raises(WeightMismatchError, match=r"\['b'\] bfloat16\[4\] on the server but"):
        client.receive({"a": jnp.zeros((2, 3)), "b": jnp.zeros(4, jnp.float32)})
    with pytest.raises(WeightMismatchError, match="2 array leaves, like_model has 1"):
        client.receive({"a": jnp.zeros((2, 3))})
    # A failed receive does not count as received: the right model still gets step 1.
    assert client.receive(right).weight_step == 1


def test_arrow_flight_does_not_resend_leaves_unchanged_since_the_clients_version():
    """Only the leaves that changed since the version a client holds travel (value
    pretraining leaves the policy as it is; frozen parts never change); a new client, or one
    that missed versions, still gets every leaf that changed since what it holds."""
    transfer = build_transfer("arrow_flight", chunk_bytes=1 << 20)
    server = transfer.server()

    def version(v: int, *, frozen: float = 7.0) -> dict:
        return {
            "big": jnp.full(300_000, frozen, jnp.float32),
            "head": jnp.full(1000, v, jnp.float32),
        }

    like = version(0, frozen=0.0)
    try:
        client = transfer.client(server.address)
        server.publish(version(1), weight_step=1)
        first = receive_step(client, like, 1)
        assert first.nbytes == (300_000 + 1000) * 4  # everything, the first time
        server.publish(version(2), weight_step=2)
        second = receive_step(client, first.model, 2)
        assert second.nbytes == 1000 * 4  # "big" is unchanged since step 1: not resent
        assert second.model["big"].tolist() == [7.0] * 300_000
        assert second.model["head"].tolist() == [2.0] * 1000
        server.publish(version(3, frozen=8.0), weight_step=3)
        third = receive_step(client, second.model, 3)
        assert third.nbytes == (300_000 + 1000) * 4 and set(third.model["big"].tolist()) == {8.0}
        late = receive_step(transfer.client(server.address), like, 3)  # a client new to it
        assert late.nbytes == (300_000 + 1000) * 4
        assert array_bytes(late.model) == array_bytes(third.model)
    finally:
        server.close()


def test_arrow_flight_config_rejects_bad_values():
    with pytest.raises(ValueError, match="port"):
        ArrowFlightConfig(port=70000)
    with pytest.raises(ValueError, match="chunk_bytes"):
        ArrowFlightConfig(chunk_bytes=0)


def test_client_in_another_process(plugin, server, tmp_path):
    child = subprocess.Popen(
        [sys.executable, __file__, plugin, server.address, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )

    def ask(seed: int, wait_for: int = 0) -> dict:
        """Receive into a model of ``seed``: once (``wait_for=0``), or until that step."""
        child.stdin.write(f"recv {seed} {wait_for}\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, f"client process exited with {child.wait(10)}"
        return json.loads(line)

    def received_bytes(reply: dict) -> list[tuple[str, bytes]]:
        with np.load(reply["file"], allow_pickle=False) as saved:
            return [
                (str(saved[f"dtype{i}"]), saved[f"leaf{i}"].tobytes())
                for i in range(len(saved.files) // 2)
            ]

    try:
        assert ask(50) == {"step": None}
        server.publish(make_model(1), weight_step=1)
        reply = ask(50, wait_for=1)
        assert reply["step"] == 1
        assert received_bytes(reply) == array_bytes(make_model(1))
        assert ask(51) == {"step": None}
        server.publish(make_model(2), weight_step=2)
        server.publish(make_model(3), weight_step=3)
        reply = ask(52, wait_for=3)
        assert reply["step"] == 3
        assert received_bytes(reply) == array_bytes(make_model(3))
    finally:
        child.stdin.close()
        assert child.wait(30) == 0


def test_a_trainer_sharded_over_4_devices_publishes_to_a_worker_with_one(plugin):
    """The trainer's weights in 4 shards (a process with 4 simulated devices); this process
    has one device and receives them whole, bit for bit."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # fmt: skip
    child = subprocess.Popen([sys.executable, __file__, "serve", plugin], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        address = child.stdout.readline().strip()
        assert address, f"the server process exited with {child.wait(10)}"
        like = {"w": jnp.zeros((8, 6), jnp.bfloat16), "v": jnp.zeros(12, jnp.float32)}
        got = receive_step(build_transfer(plugin).client(address), like, 1)
        assert got.model["w"].tolist() == jnp.arange(48).reshape(8, 6).astype(jnp.bfloat16).tolist()
        assert got.model["v"].tolist() == list(range(12))
    finally:
        child.stdin.close()
        assert child.wait(30) == 0


def _sharded_server_process(name: str) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    server = build_transfer(name).server()
    model = {
        "w": jax.device_put(jnp.arange(48).reshape(8, 6).astype(jnp.bfloat16),
                            NamedSharding(mesh, PartitionSpec("data", "model"))),
        "v": jax.device_put(jnp.arange(12, dtype=jnp.float32),
                            NamedSharding(mesh, PartitionSpec("data"))),
    }  # fmt: skip
    server.publish(model, weight_step=1)
    print(server.address, flush=True)
    sys.stdin.read()  # serve until the test closes stdin
    server.close()


def _client_process(name: str, address: str, outdir: str) -> None:
    client = build_transfer(name).client(address)
    for n, line in enumerate(sys.stdin):
        _, seed, wait_for = line.split()
        like = make_model(int(seed))
        if int(wait_for):
            got = receive_step(client, like, int(wait_for))
        else:
            got = client.receive(like)
        if got is None:
            print(json.dumps({"step": None}), flush=True)
            continue
        model, step = got.model, got.weight_step
        arrays = {}
        for i, (dtype, data) in enumerate(array_bytes(model)):
            arrays[f"leaf{i}"] = np.frombuffer(data, np.uint8)
            arrays[f"dtype{i}"] = np.asarray(dtype)
        path = Path(outdir) / f"received{n}.npz"
        np.savez(path, **arrays)
        print(json.dumps({"step": step, "file": str(path)}), flush=True)
    client.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _sharded_server_process(sys.argv[2])
    else:
        _client_process(sys.argv[1], sys.argv[2], sys.argv[3])
