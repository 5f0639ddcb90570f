"""`marinrl run --ray-address` on a cluster started beforehand with `ray start --head`, and a
job without an address starting its own Ray even while that cluster runs. Both jobs run as
subprocesses of the CLI, as a user runs them, so no Ray state of this test process is involved."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# Opt-in (`nox -s cluster`): starting a separate cluster takes a while.
pytestmark = pytest.mark.cluster

# The environment of every process that talks to the test cluster. Token auth is off: it is a
# loopback test cluster. Set explicitly, not inherited: an in-process ray.init() earlier in the
# session (test_job) sets RAY_AUTH_MODE=token in os.environ, and a driver in token mode could
# not create actors on this cluster.
CLUSTER_ENV = dict(os.environ, RAY_AUTH_MODE="disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Ray nodes started with ``ray start --block``, each in its own process group, so that
    the teardown stops exactly these."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ray_bin = str(Path(sys.executable).with_name("ray"))

    def start(self, *args: str, env: dict[str, str] = CLUSTER_ENV) -> None:
        self.procs.append(
            subprocess.Popen(
                [self.ray_bin, "start", "--block", "--disable-usage-stats", *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        )

    def wait_for(self, address: str, count: int) -> None:
        """Until ``ray status`` shows ``count`` live nodes."""
        deadline = time.time() + 120
        while True:
            status = subprocess.run(
                [self.ray_bin, "status", f"--address={address}"],
                capture_output=True,
                text=True,
                env=CLUSTER_ENV,
            )
            active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if status.returncode == 0 and active.count(" node_") >= count:
                return
            if any(p.poll() is not None for p in self.procs) or time.time() > deadline:
                self.stop()
                pytest.fail(f"the Ray cluster at {address} did not come up:\n{status}")
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 3 s: once a job has run on it, a ``ray start --block``
        node's raylet takes ~30 s to stop on SIGTERM (measured 2026-12-01, Ray 2.60), waiting
        for nothing this test needs; the processes of the group go either way."""
        for proc in reversed(self.procs):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)


@pytest.fixture(scope="module")
def ray_cluster():
    """A separately started single-node Ray cluster; yields its address."""
    port = free_port()
    # Its own temp dir, apart from the other Ray instances of this test session.
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    nodes = Nodes()
    nodes.start(
        "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
        f"--temp-dir={temp_dir}",
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    nodes.wait_for(address, 1)
    yield address
    nodes.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a second node on this machine, each with one ``rollout_slot`` and one
    ``trainer_slot``. (Ray gives a cluster node the machine's own network address, not
    127.0.0.1; the traffic stays on this machine.)"""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    nodes = Nodes()
    slot = '{"rollout_slot": 1, "trainer_slot": 1}'
    nodes.start(
        "--head", f"--port={port}", "--num-cpus=2", f"--resources={slot}",
        "--include-dashboard=false", f"--temp-dir={temp_dir}",
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    nodes.wait_for(address, 1)
    nodes.start(f"--address={address}", "--num-cpus=1", f"--resources={slot}")
    nodes.wait_for(address, 2)
    yield address
    nodes.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def run_job(tiny_mock_job: list[str]) -> Callable[..., tuple[str, Path]]:
    """``run_job(tmp_path, run_id, *extra)`` runs a two-step mock job through the CLI in a
    subprocess and returns its driver log and run directory."""
    return functools.partial(
        _run_job, ["run", *tiny_mock_job, "--set", "trainer.num_train_steps=2"]
    )


def _run_job(job: list[str], tmp_path: Path, run_id: str, *extra: str) -> tuple[str, Path]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "marin_rl_core",
            *job,
            "--set",
            f'run_dir="{tmp_path}"',
            "--run-id",
            run_id,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=CLUSTER_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / run_id
    return (run_dir / "driver.log").read_text(), run_dir


def trained_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["source"] == "train"]


def test_ray_address_runs_the_job_on_that_cluster(ray_cluster, run_job, tmp_path):
    log, run_dir = run_job(tmp_path, "on-cluster", "--ray-address", ray_cluster)
    port = ray_cluster.rsplit(":", 1)[1]
    assert "using the Ray cluster at" in log and f":{port}" in log, log
    assert trained_steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_without_an_address_the_job_starts_its_own_ray_beside_a_running_cluster(
    ray_cluster, run_job, tmp_path
):
    # `ray start` recorded the cluster's address; a plain ray.init() would join that cluster.
    log, run_dir = run_job(tmp_path, "local")
    port = ray_cluster.rsplit(":", 1)[1]
    assert "started a local Ray cluster at" in log and f":{port}" not in log, log
    assert trained_steps(run_dir) == [1, 2]


@pytest.mark.slow  # with its two-node cluster ~110 s; --ray-address runs in the default run
def test_rollout_workers_spread_over_two_nodes_and_the_job_finishes(
    two_node_cluster, run_job, tmp_path
):
    """Each node has one rollout_slot and each worker asks for one, so Ray must place the two
    rollout workers on different nodes."""
    log, run_dir = run_job(
        tmp_path, "two-nodes", "--ray-address", two_node_cluster,
        "--set", "num_rollout_workers=2",
        "--set", "resources.rollout.custom={rollout_slot = 1}",
    )  # fmt: skip
    assert "2 node(s) at" in log, log
    placed = {}
    for i in range(2):
        text = (run_dir / "logs" / f"rollout-{i}.log").read_text()
        placed[i] = re.search(rf"rollout worker {i} process \d+ on node (\w+) \(([^)]*)\)", text)
        assert placed[i], text
    assert placed[0].group(1) != placed[1].group(1), "both rollout workers on one node"
    assert trained_steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_a_trainer_over_two_hosts_spans_both_nodes_and_the_job_finishes(
    two_node_cluster, run_job, tmp_path
):
    """``resources.trainer_hosts=2``, each host asking for the one ``trainer_slot`` a node has:
    Ray places a trainer process on each node, they join over the machine's network address
    (not loopback) and train one model over both nodes' devices."""
    log, run_dir = run_job(
        tmp_path, "two-hosts", "--ray-address", two_node_cluster,
        "--set", "resources.trainer_hosts=2",
        "--set", "resources.trainer.custom={trainer_slot = 1}",
    )  # fmt: skip
    assert "placed the trainer's 2 hosts" in log, log
    nodes = []
    for name in ("trainer", "trainer-1"):
        text = (run_dir / "logs" / f"{name}.log").read_text()
        found = re.search(r"process \d+ on node (\w+) \(([^)]*)\)", text)
        assert found, text
        nodes.append(found.group(1))
        assert "of 2 joined at" in text and "1 local of 2 devices" in text, text
    assert nodes[0] != nodes[1], "both trainer hosts on one node"
    assert "over 2 device(s)" in (run_dir / "logs" / "trainer.log").read_text()
    assert trained_steps(run_dir) == [1, 2]
