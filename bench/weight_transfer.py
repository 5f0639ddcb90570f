"""Weight sync across processes, each plugin beside this machine's memcpy, in one run.

    python bench/weight_transfer.py [--trees half_gb,qwen3_0.6b] [--repeats 3] [--steps 10]
                                    [--step-seconds 2]

For each parameter tree (``half_gb``: 32 float32 leaves of 4 M values, 0.5 GB; ``qwen3_0.6b``:
the leaves of Qwen3-0.6B in bfloat16, 596 M parameters, 1.19 GB):

- memcpy: one numpy copy of the same bytes in this process (the physical limit);
- tcp: the same bytes through one loopback TCP socket between two threads (the limit of any
  transport over TCP on this machine, Flight's included);
- for each plugin (``arrow_flight``, ``jax``): the trainer side (this process) publishes a new
  version (every leaf changed) as the trainer does (``publish_copy`` then ``server.publish``),
  and a client in another process, polling every 5 ms, receives it into its own arrays:
  publish->received seconds (median of ``--repeats``), GB/s and the ratios to memcpy and tcp;
- step time: a stand-in train step, timed for ``--steps`` steps without publishing, then
  publishing every step while the client receives whatever is newest; the ratio (target <=
  1.05x). The step updates the whole tree (donating it, as a train step does) and runs a chain of
  2048x2048 matmuls sized to take about ``--step-seconds`` (a real step of a model this size takes
  seconds on an accelerator, minutes on this CPU).

On a GPU machine the trees live on the GPU, so the ``jax`` figures are device to device there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def tree_shapes(name: str) -> list[tuple[tuple[int, ...], str]]:
    """``[(shape, dtype)]`` of each leaf of the named tree."""
    if name == "half_gb":
        return [((4 * 2**20,), "float32")] * 32
    if name == "qwen3_0.6b":
        hidden, inter, layers, vocab, heads, kv, head_dim = 1024, 3072, 28, 151936, 16, 8, 128
        leaves = [((vocab, hidden), "bfloat16"), ((hidden,), "bfloat16")]
        for _ in range(layers):
            leaves += [
                ((hidden, heads * head_dim), "bfloat16"),
                ((hidden, kv * head_dim), "bfloat16"),
                ((hidden, kv * head_dim), "bfloat16"),
                ((heads * head_dim, hidden), "bfloat16"),
                ((hidden, inter), "bfloat16"),
                ((hidden, inter), "bfloat16"),
                ((inter, hidden), "bfloat16"),
                ((hidden,), "bfloat16"),
                ((hidden,), "bfloat16"),
                ((head_dim,), "bfloat16"),
                ((head_dim,), "bfloat16"),
            ]
        return leaves
    raise SystemExit(f"unknown tree {name!r}")


def make_tree(name: str, value: float = 0.0) -> list:
    import jax.numpy as jnp

    return [jnp.full(shape, value, dtype) for shape, dtype in tree_shapes(name)]


def transfer(plugin: str):
    from marin_rl_core.registry import build_registry

    record = build_registry().get("weight_transfer", plugin)
    return record.build(record.config_class())


# --- the client process ------------------------------------------------------------------------


def client_main(plugin: str, address: str, tree: str) -> None:
    """Receive into a tree of ``tree``'s shapes until stdin closes; print ``{"step", "time"}``
    for each version received."""
    import threading

    like = make_tree(tree)
    client = transfer(plugin).client(address)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    while not done.is_set():
        got = client.receive(like)
        if got is None:
            time.sleep(0.005)
            continue
        import jax

        jax.block_until_ready(got.model)
        like = got.model
        print(json.dumps({"step": got.weight_step, "time": time.time(),
                          "seconds": got.seconds, "bytes": got.nbytes}), flush=True)  # fmt: skip


# --- the trainer side --------------------------------------------------------------------------


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def tcp_gbps(nbytes: int, repeats: int) -> float:
    """The same bytes through one loopback TCP socket, sender and receiver in two threads."""
    import socket
    import threading

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = threading.Thread(
            target=lambda: [listener.accept()[0].sendall(memoryview(src)) for _ in range(repeats)],
            daemon=True,
        )
        sender.start()
        times = []
        view = memoryview(dst)
        for _ in range(repeats):
            with socket.create_connection(listener.getsockname()) as conn:
                start, got = time.perf_counter(), 0
                while got < nbytes:
                    got += conn.recv_into(view[got:], nbytes - got)
                times.append(time.perf_counter() - start)
        sender.join(60)
    return nbytes / min(times) / 1e9


def measure(
    plugin: str, tree: str, repeats: int, steps: int, step_seconds: float
) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from marin_rl_core.models.build import publish_copy

    server = transfer(plugin).server()
    child = subprocess.Popen(
        [sys.executable, __file__, "--client", plugin, server.address, tree],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert json.loads(child.stdout.readline())["ready"]
    params = make_tree(tree, 1.0)
    nbytes = sum(int(x.nbytes) for x in params)
    h0 = jnp.ones((2048, 2048), jnp.float32) / 2048

    def chain(n: int):
        def step(p, h):
            for _ in range(n):
                h = jnp.tanh(h @ h0)
            return [x + jnp.asarray(1, x.dtype) for x in p], h

        return jax.jit(step, donate_argnums=0)

    probe = chain(4)
    params, h = jax.block_until_ready(probe(params, h0))
    start = time.perf_counter()
    params, h = jax.block_until_ready(probe(params, h))
    n = max(1, round(4 * step_seconds / (time.perf_counter() - start)))
    step_fn = chain(n)
    params, h = jax.block_until_ready(step_fn(params, h))
    # Every version differs from the last in every leaf, as after a train step (a plugin that
    # skips unchanged leaves must still send them all).
    bump = jax.jit(lambda p: [x + jnp.asarray(1, x.dtype) for x in p], donate_argnums=0)
    latencies = []
    version = 0
    for _ in range(repeats + 1):  # the first one warms up both sides
        version += 1
        params = jax.block_until_ready(bump(params))
        start = time.time()
        server.publish(publish_copy(params, params[0].dtype), weight_step=version)
        while True:
            reply = json.loads(child.stdout.readline())
            if reply["step"] == version:
                break
        latencies.append(reply["time"] - start)
    latency = statistics.median(latencies[1:])

    def timed(publish: bool) -> float:
        nonlocal params, version, h
        start = time.perf_counter()
        for _ in range(steps):
            params, h = step_fn(params, h)
            if publish:
                version += 1
                server.publish(publish_copy(params, params[0].dtype), weight_step=version)
        jax.block_until_ready(params)
        return (time.perf_counter() - start) / steps

    without = timed(False)
    with_publish = timed(True)
    child.stdin.close()
    child.wait(60)
    server.close()
    return {
        "nbytes": nbytes,
        "latency_s": latency,
        "gbps": nbytes / latency / 1e9,
        "step_s": without,
        "step_publish_s": with_publish,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="half_gb,qwen3_0.6b")
    parser.add_argument("--plugins", default="arrow_flight,jax")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=2.0)
    parser.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(*args.client)
        return
    import jax

    print(f"devices: {jax.devices()}  cores: {os.cpu_count()}")
    header = (f"{'tree':<11} {'plugin':<13} {'GB':>5} {'memcpy GB/s':>11} {'tcp GB/s':>8} "
              f"{'publish->recv s':>15} "
              f"{'GB/s':>6} {'of memcpy':>9} {'of tcp':>6} {'step ms':>8} {'+publish':>8} {'ratio':>6}")  # fmt: skip
    print(header)
    for tree in args.trees.split(","):
        nbytes = sum(int(np.prod(s)) * np.dtype(d if d != "bfloat16" else "float16").itemsize
                     for s, d in tree_shapes(tree))  # fmt: skip
        memcpy = memcpy_gbps(nbytes, args.repeats + 1)
        tcp = tcp_gbps(nbytes, args.repeats + 1)
        for plugin in args.plugins.split(","):
            r = measure(plugin, tree, args.repeats, args.steps, args.step_seconds)
            print(f"{tree:<11} {plugin:<13} {r['nbytes'] / 1e9:>5.2f} {memcpy:>11.1f} {tcp:>8.1f} "
                  f"{r['latency_s']:>15.3f} {r['gbps']:>6.2f} {r['gbps'] / memcpy:>8.1%} "
                  f"{r['gbps'] / tcp:>6.0%} "
                  f"{r['step_s'] * 1e3:>8.1f} {r['step_publish_s'] * 1e3:>8.1f} "
                  f"{r['step_publish_s'] / r['step_s']:>5.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
