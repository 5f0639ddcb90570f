"""Rollout storage throughput and size, each plugin side by side in one run.

    python bench/storage.py [--batches 40] [--rollouts 64] [--tokens 512]

A realistic batch: ``--rollouts`` rollouts (groups of 8) of ``--tokens`` tokens each (a quarter
prompt, the rest response), with per-token logprobs, loss mask and token rewards. For each
storage (``memory`` through a local Ray; ``gcs`` on a local path; ``gcs`` on a loopback
gcp-storage-emulator, and on moto's S3, when installed) one writer writes ``--batches`` batches
and then one reader reads them all: rollouts/s and MB/s each way (MB of the wire format).

Size: the wire format's bytes per rollout against the raw bytes of the same arrays (numpy
``tobytes`` of tokens int32, loss mask bool, logprobs and token rewards float32, reward and
timestamp float64; no headers) — the target is at most 1.2x.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def make_batch(n: int, tokens: int, seed: int = 0):
    from marin_rl_core import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

    rng = np.random.default_rng(seed)
    prompt = tokens // 4
    groups = []
    for g in range(max(n // 8, 1)):
        rollouts = []
        for k in range(min(8, n)):
            response = rng.integers(3, 32000, size=tokens - prompt).astype(np.int32)
            rollouts.append(
                Rollout.single_turn(
                    env_name="math",
                    lesson_id="gsm8k",
                    problem_id=f"p{g}",
                    prompt_tokens=rng.integers(3, 32000, size=prompt).astype(np.int32),
                    response_tokens=response,
                    response_logprobs=-rng.exponential(1.0, size=response.size).astype(np.float32),
                    reward=float(k % 2),
                    metadata=RolloutMetadata(worker_id="w0", timestamp=time.time(), weight_step=3),
                )  # fmt: skip
            )
        groups.append(RolloutGroup(rollouts=rollouts))
    return RolloutBatch(groups=groups)


def raw_bytes(batch) -> int:
    """The same arrays as raw bytes (numpy ``tobytes``, no headers): what a rollout costs
    without any format."""
    total = 0
    for r in batch.rollouts:
        for array in (r.tokens.astype(np.int32), r.loss_mask.astype(bool),
                      r.logprobs.astype(np.float32), r.token_rewards.astype(np.float32),
                      np.asarray([r.reward, r.metadata.timestamp], np.float64)):  # fmt: skip
            total += len(array.tobytes())
    return total


def measure(storage, batch, n: int) -> tuple[float, float]:
    """Seconds to write ``n`` batches, then to read them all."""
    writer = storage.writer(name="rollout-0")
    start = time.perf_counter()
    for _ in range(n):
        writer.write_batch(batch, timeout=120)
    wrote = time.perf_counter() - start
    reader = storage.reader()
    got, start = 0, time.perf_counter()
    while got < n:
        got += len(reader.read_batches(max_batches=n - got, timeout=5))
    return wrote, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()

    from marin_rl_plugins.memory_storage import MemoryStorageConfig, build_memory_storage
    from marin_rl_plugins.object_storage import ObjectStorageConfig, build_object_storage

    from marin_rl_core import RunInfo
    from marin_rl_core.rollout_serialization import serialize_rollout_batch
    from marin_rl_core.testing import free_port, serve_on_loopback

    batch = make_batch(args.rollouts, args.tokens)
    wire = len(serialize_rollout_batch(batch))
    raw = raw_bytes(batch)
    n_rollouts = len(batch.rollouts)
    tmp = tempfile.mkdtemp(prefix="marinrl-bench-storage-")
    run = RunInfo(run_id="bench", run_dir=tmp)
    bin_dir = os.path.dirname(sys.executable)
    servers = []
    backends: list[tuple[str, object]] = []

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    backends.append(("memory (Ray queue)", build_memory_storage(
        MemoryStorageConfig(capacity=args.batches + 1), run)))  # fmt: skip
    fast = {"poll_interval_s": 0.01, "max_unread_batches": 0}
    backends.append(("gcs on a local path", build_object_storage(ObjectStorageConfig(**fast), run)))
    gcs_port, s3_port = free_port(), free_port()
    os.environ.update(
        STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{gcs_port}",
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}",
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="eu-west-1",
    )  # fmt: skip
    for scheme, argv, port in (
        ("gs", [os.path.join(bin_dir, "gcp-storage-emulator"), "start", "--host", "127.0.0.1",
                "--port", str(gcs_port), "--in-memory"], gcs_port),
        ("s3", [os.path.join(bin_dir, "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)],
         s3_port),
    ):  # fmt: skip
        proc = serve_on_loopback(argv, port)
        if proc is None:
            print(f"({scheme}: its loopback server is not installed; pip install 'marin-rl[test]')")
            continue
        servers.append(proc)
        import fsspec

        fs, _ = fsspec.core.url_to_fs(f"{scheme}://bench", skip_instance_cache=True)
        fs.mkdir("bench", **({"region_name": "eu-west-1"} if scheme == "s3" else {}))
        name = "gcp-storage-emulator" if scheme == "gs" else "moto (S3)"
        config = ObjectStorageConfig(url=f"{scheme}://bench/rollouts", **fast)
        backends.append((f"gcs on {name}", build_object_storage(config, run)))

    print(f"batch: {n_rollouts} rollouts x {args.tokens} tokens; {args.batches} batches each way")
    print(f"{'storage':28} {'write r/s':>10} {'write MB/s':>10} {'read r/s':>10} {'read MB/s':>10}")
    try:
        for name, storage in backends:
            wrote, read = measure(storage, batch, args.batches)
            total_r, total_mb = n_rollouts * args.batches, wire * args.batches / 1e6
            print(f"{name:28} {total_r / wrote:10.0f} {total_mb / wrote:10.1f} "
                  f"{total_r / read:10.0f} {total_mb / read:10.1f}")  # fmt: skip
            storage.close()
    finally:
        for proc in servers:
            proc.kill()
        ray.shutdown()
    print(f"\nbytes per rollout: wire format {wire / n_rollouts:.0f}, raw numpy dump "
          f"{raw / n_rollouts:.0f}: {wire / raw:.2f}x (target <= 1.2x)")  # fmt: skip


if __name__ == "__main__":
    main()
