"""The whole Ray job, for a few steps on the mock env: rollouts flow, weights sync, every rollout
carries its metadata, stale rollouts are dropped, and a second run resumes from the checkpoint.

The job runs on a Ray cluster started beforehand with ``ray start --head`` and is given its
address (``ray_address``, the CLI's ``--ray-address``), as on a real cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.job import RLJob
from marin_rl_core.metrics import read_metrics

SMALL = [
    "trainer.batch_size=32",
    "sampling.n_prompts=4",
    "sampling.n_generations_per_prompt=8",
    "eval.frequency=2",
    "eval.n_examples=8",
    "eval.micro_frequency=2",
    "eval.micro_n_examples=4",
    "trainer.checkpoint_interval_steps=2",
    # Only on-policy rollouts: anything sampled with older weights than the trainer's is dropped.
    "replay_buffer.max_rollout_step_delay=0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A separately started single-node Ray cluster; yields its address. ``--block`` keeps
    ``ray start`` in the foreground, in its own process group, so that the teardown stops
    exactly this cluster. (Token auth is off: it is a loopback test cluster.)"""
    port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )

    def stop() -> None:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=20)

    address = f"127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        status = subprocess.run(
            [ray_bin, "status", f"--address={address}"], capture_output=True, text=True, env=env
        )
        if status.returncode == 0:
            break
        if head.poll() is not None or time.time() > deadline:
            stop()
            pytest.fail(f"the Ray head at {address} did not come up:\n{status.stderr[-2000:]}")
        time.sleep(1)
    yield address
    stop()


@pytest.fixture(scope="module")
def first_run(ray_cluster, tmp_path_factory):
    import ray

    assert not ray.is_initialized()
    registry = build_registry()
    run_dir = tmp_path_factory.mktemp("runs")
    config = resolve_config(
        registry,
        selections={"env": "mock"},
        overrides=[
            *SMALL,
            f'run_dir="{run_dir}"',
            'run_id="job"',
            "trainer.num_train_steps=4",
            f'ray_address="{ray_cluster}"',
        ],
    )
    result = RLJob(config, registry).run(progress=False)
    return result, registry, run_dir


def test_the_job_ran_on_the_cluster_it_was_given(first_run, ray_cluster):
    result, _, _ = first_run
    assert result.ray_address.endswith(":" + ray_cluster.rsplit(":", 1)[1])


def test_rollouts_flow_and_weights_sync(first_run):
    result, _, _ = first_run
    assert result.final_step == 4 and not result.interrupted
    (counters,) = result.rollout_counters
    assert counters["batches_written"] >= 1
    assert counters["weight_syncs"] >= 2
    train = [r for r in read_metrics(result.run_dir) if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert sum(r["replay/new_rollouts"] for r in train if "replay/new_rollouts" in r) >= 4 * 32


def test_every_trained_rollout_carries_metadata_and_none_is_stale(first_run):
    result, _, _ = first_run
    samples = [
        json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    assert samples
    start = read_metrics(result.run_dir)[0]["time"]
    for s in samples:
        assert s["worker_id"].endswith("-w0")
        assert s["timestamp"] >= start - 120
        # The batch logged at step k was trained at step k-1: with max delay 0 its rollouts
        # were sampled with weights of step k-1 exactly.
        assert s["weight_step"] == s["step"] - 1


def test_stale_rollouts_were_dropped(first_run):
    result, _, _ = first_run
    train = [r for r in read_metrics(result.run_dir) if r["source"] == "train"]
    assert sum(r.get("replay/dropped_stale_step", 0) for r in train) > 0


def test_held_out_eval_runs_at_start_and_on_the_final_weights(first_run):
    result, _, _ = first_run
    evals = [r for r in read_metrics(result.run_dir) if r["source"] == "eval"]
    steps = [r["step"] for r in evals]
    assert steps[0] == 0 and steps[-1] == 4
    assert all(r["eval/mock/n"] == 8 for r in evals)
    assert "eval/mock/reward" in result.final_eval


def test_micro_evals_score_the_lesson_being_sampled(first_run):
    result, _, _ = first_run
    rows = [r for r in read_metrics(result.run_dir) if "micro_eval/mock/reward" in r]
    assert rows, "eval.micro_frequency=2 logged no micro-eval"
    assert all(0.0 <= r["micro_eval/mock/reward"] <= 1.0 for r in rows)
    batches = [r for r in read_metrics(result.run_dir) if "rollout/lesson" in r]
    assert len(rows) <= len(batches) // 2  # one before every 2nd batch, not before the first


def test_a_second_run_resumes_from_the_checkpoint(first_run, ray_cluster):
    result, registry, run_dir = first_run
    config = resolve_config(
        registry,
        files=[result.run_dir / "config.toml"],
        # No address: a local Ray of its own, although `ray start` left a cluster running.
        overrides=["trainer.num_train_steps=6", 'ray_address=""'],
    )
    again = RLJob(config, registry).run(progress=False)
    assert again.ray_address and again.ray_address != result.ray_address
    assert again.run_dir == result.run_dir
    train = [r for r in read_metrics(again.run_dir) if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # 5 and 6 come from the resumed run
    assert again.final_step == 6
    assert (Path(again.run_dir) / "checkpoints" / "step-000006" / "model.eqx").exists()


def test_report_draws_the_reward_curve(first_run, cli):
    result, _, _ = first_run
    out = cli("report", str(result.run_dir))
    assert out.exit_code == 0, out.output
    png = result.run_dir / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mock" in out.output
