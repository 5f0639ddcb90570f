"""The ``arrow_flight`` weight transfer, in process and with a client in another process.

Run as a script (``python test_arrow_flight.py ADDRESS OUTDIR``) this module is that other
process: it reads ``recv SEED`` lines on stdin, receives weights into a model built from SEED
and answers with one JSON line per command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from marin_rl_plugins import arrow_flight  # noqa: E402
from marin_rl_plugins.arrow_flight import ArrowFlightConfig, WeightMismatchError  # noqa: E402

from marin_rl_core.registry import build_registry  # noqa: E402


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


@pytest.fixture
def transfer():
    registry = build_registry(autoload=False, modules=[arrow_flight])
    record = registry.get("weight_transfer", "arrow_flight")
    # A tiny chunk size so that leaves are split over several record batches.
    return record.build(record.config_class(chunk_bytes=100))


@pytest.fixture
def server(transfer):
    srv = transfer.server()
    yield srv
    srv.close()


def test_client_gets_each_newer_version_bit_exactly(transfer, server):
    assert server.address.startswith("grpc+tcp://127.0.0.1:")
    client = transfer.client(server.address)
    like = make_model(seed=100)
    assert client.receive(like) is None  # nothing published yet

    for step, seed in [(1, 1), (2, 2), (5, 3)]:
        published = make_model(seed)
        server.publish(published, weight_step=step)
        got = client.receive(like)
        assert got is not None
        model, got_step = got
        assert got_step == step
        assert array_bytes(model) == array_bytes(published)
        assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(like)
        assert isinstance(model.head.weight.array, jax.Array)
        assert model.head.weight.axes == like.head.weight.axes
        assert client.receive(like) is None  # nothing newer: no download

    metrics = client.get_metrics()
    assert metrics["weight_transfer/client/fetches"] == 3
    assert metrics["weight_transfer/client/info_calls"] == 7
    nbytes = sum(len(b) for _, b in array_bytes(like))
    assert metrics["weight_transfer/client/bytes_received"] == 3 * nbytes
    assert server.get_metrics()["weight_transfer/server/bytes_sent"] == 3 * nbytes
    client.close()


def test_a_client_that_falls_behind_gets_only_the_latest(transfer, server):
    client = transfer.client(server.address)
    for step in (1, 2, 3):
        server.publish(make_model(step), weight_step=step)
    model, step = client.receive(make_model(0))
    assert step == 3 and array_bytes(model) == array_bytes(make_model(3))
    assert client.get_metrics()["weight_transfer/client/fetches"] == 1
    client.close()


def test_publish_copies_so_later_changes_do_not_leak(transfer, server):
    params = np.arange(8, dtype=np.float32)
    server.publish({"w": params}, weight_step=1)
    params[:] = -1  # e.g. a donated buffer reused by the next step
    model, _ = transfer.client(server.address).receive({"w": np.zeros(8, np.float32)})
    assert model["w"].tolist() == list(range(8))


def test_weight_steps_must_increase(server):
    server.publish(make_model(0), weight_step=3)
    with pytest.raises(ValueError, match="must increase"):
        server.publish(make_model(0), weight_step=3)


def test_a_differently_shaped_like_model_is_refused_with_the_leaf(transfer, server):
    server.publish({"a": jnp.zeros((2, 3)), "b": jnp.zeros(4, jnp.bfloat16)}, weight_step=1)
    client = transfer.client(server.address)
    with pytest.raises(WeightMismatchError, match=r"\['b'\] bfloat16\[4\] on the server but"):
        client.receive({"a": jnp.zeros((2, 3)), "b": jnp.zeros(4, jnp.float32)})
    with pytest.raises(WeightMismatchError, match="2 array leaves, like_model has 1"):
        client.receive({"a": jnp.zeros((2, 3))})
    # A failed receive does not count as received: the right model still gets step 1.
    assert client.receive({"a": jnp.ones((2, 3)), "b": jnp.ones(4, jnp.bfloat16)})[1] == 1


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="port"):
        ArrowFlightConfig(port=70000)
    with pytest.raises(ValueError, match="chunk_bytes"):
        ArrowFlightConfig(chunk_bytes=0)


def test_client_in_another_process(transfer, server, tmp_path):
    child = subprocess.Popen(
        [sys.executable, __file__, server.address, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )

    def ask(seed: int) -> dict:
        child.stdin.write(f"recv {seed}\n")
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
        reply = ask(50)
        assert reply["step"] == 1
        assert received_bytes(reply) == array_bytes(make_model(1))
        assert ask(51) == {"step": None}
        server.publish(make_model(2), weight_step=2)
        server.publish(make_model(3), weight_step=3)
        reply = ask(52)
        assert reply["step"] == 3
        assert received_bytes(reply) == array_bytes(make_model(3))
        assert server.get_metrics()["weight_transfer/server/fetches_served"] == 2
    finally:
        child.stdin.close()
        assert child.wait(30) == 0


def _client_process(address: str, outdir: str) -> None:
    from marin_rl_plugins.arrow_flight import build_arrow_flight

    client = build_arrow_flight(ArrowFlightConfig()).client(address)
    for n, line in enumerate(sys.stdin):
        seed = int(line.split()[1])
        got = client.receive(make_model(seed))
        if got is None:
            print(json.dumps({"step": None}), flush=True)
            continue
        model, step = got
        arrays = {}
        for i, (dtype, data) in enumerate(array_bytes(model)):
            arrays[f"leaf{i}"] = np.frombuffer(data, np.uint8)
            arrays[f"dtype{i}"] = np.asarray(dtype)
        path = Path(outdir) / f"received{n}.npz"
        np.savez(path, **arrays)
        print(json.dumps({"step": step, "file": str(path)}), flush=True)
    client.close()


if __name__ == "__main__":
    _client_process(sys.argv[1], sys.argv[2])
