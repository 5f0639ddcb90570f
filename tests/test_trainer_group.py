"""A trainer group: 2 processes x 2 simulated CPU devices (``jax.distributed`` on 127.0.0.1,
gloo collectives) run the whole trainer loop as one trainer over 4 devices, with the leader
reading rollouts, publishing and checkpointing and the other process following it
(``tests/group_trainer.py``). It trains exactly like 1 process x 4 devices, serves the weights
it trained, and its checkpoint resumes on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("group_trainer.py")
STEPS = 3


def _write_rollouts(directory: Path) -> None:
    """Ten batches of two groups of two rollouts with different rewards (mock env tokens)."""
    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata, RunInfo

    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "mock", "storage": "gcs"},
        overrides=[f'storage.url="{directory}"'],
    )  # fmt: skip
    storage = registry.get("storage", "gcs").build(
        config.storage.config, RunInfo(run_id="r", run_dir=str(directory))
    )
    writer = storage.writer(name="rollout-0")
    rng = np.random.default_rng(0)
    for index in range(10):
        groups = [
            RolloutGroup(
                rollouts=[
                    Rollout.single_turn(
                        env_name="mock",
                        lesson_id=config.curriculum.lessons[0].id,
                        problem_id=f"{index}/{g}",
                        prompt_tokens=rng.integers(3, 60, size=4).astype(np.int32),
                        response_tokens=rng.integers(3, 60, size=3).astype(np.int32),
                        response_logprobs=-rng.uniform(2.0, 4.0, size=3).astype(np.float32),
                        reward=float(k),
                        metadata=RolloutMetadata(
                            worker_id="w",
                            timestamp=time.time(),
                            weight_step=0,
                            worker_index=0,
                            batch_index=index,
                        ),
                    )  # fmt: skip
                    for k in range(2)
                ]
            )
            for g in range(2)
        ]
        writer.write_batch(RolloutBatch(groups=groups), timeout=30)


def _run(devices: int, steps: int, runs: list[tuple[Path, Path, Path, int]], group: int = 0):
    """``group_trainer.py`` with one ``--run`` per ``(run_dir, rollouts, out, lora_rank)``, one
    after the other in the same process (or each process of a group of ``group``); returns
    what each run wrote to its ``out``."""
    argv = [str(SCRIPT), str(devices), str(steps)]
    for run_dir, rollouts, out, lora in runs:
        argv += ["--run", f"{run_dir},{rollouts},{out},{lora}"]
    if group:
        from test_sharding import run_group

        run_group(argv, group)
    else:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(out.read_text()) for _, _, out, _ in runs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """2 processes x 2 devices and 1 process x 4 devices, each training the whole model and then
    LoRA adapters (two runs a process), and the group's checkpoint resumed on 1 device."""
    tmp = tmp_path_factory.mktemp("trainer-group")
    names = ("group", "single", "group-lora", "single-lora")
    for name in names:
        _write_rollouts(tmp / f"rollouts-{name}")
    spec = {
        name: (tmp / f"run-{name}", tmp / f"rollouts-{name}", tmp / f"{name}.json",
               4 if name.endswith("lora") else 0)
        for name in names
    }  # fmt: skip
    group, group_lora = _run(2, STEPS, [spec["group"], spec["group-lora"]], group=2)
    single, single_lora = _run(4, STEPS, [spec["single"], spec["single-lora"]])
    resumed = (tmp / "run-group", tmp / "rollouts-group", tmp / "resumed.json", 0)
    (resumed,) = _run(1, STEPS + 1, [resumed])
    return {
        "group": group, "single": single, "resumed": resumed,
        "group-lora": group_lora, "single-lora": single_lora,
    }  # fmt: skip


def test_a_trainer_group_runs_the_trainer_loop_like_one_process(runs):
    group, single = runs["group"], runs["single"]
    assert (group["processes"], group["devices"]) == (2, 4)
    assert (single["processes"], single["devices"]) == (1, 4)
    assert group["step"] == single["step"] == STEPS
    assert sorted(group["losses"]) == [str(s) for s in range(1, STEPS + 1)]
    for step, loss in single["losses"].items():
        np.testing.assert_allclose(group["losses"][step], loss, rtol=1e-5)
    np.testing.assert_allclose(group["params"], single["params"], rtol=1e-5)


def test_a_trainer_group_trains_lora_adapters_like_one_process_and_serves_them_alone(runs):
    group, single = runs["group-lora"], runs["single-lora"]
    assert (group["processes"], group["devices"]) == (2, 4)
    assert group["step"] == single["step"] == STEPS
    for step, loss in single["losses"].items():
        np.testing.assert_allclose(group["losses"][step], loss, rtol=1e-5)
    np.testing.assert_allclose(group["params"], single["params"], rtol=1e-5)
    # What the leader served is the adapters (fewer leaves than the model), as trained.
    assert group["received_step"] == STEPS
    assert len(group["received"]) == len(group["served"]) < len(group["params"])
    np.testing.assert_allclose(group["received"], group["served"], rtol=1e-5)
    assert any(s > 0 for s in group["served"][1::2]), "lora_B trained away from zero"


def test_the_leader_serves_the_weights_the_group_trained(runs):
    group = runs["group"]
    assert group["received_step"] == STEPS
    np.testing.assert_allclose(group["received"], group["params"], rtol=1e-3)


def test_the_checkpoint_of_a_trainer_group_resumes_on_one_process(runs):
    resumed = runs["resumed"]
    assert (resumed["processes"], resumed["devices"]) == (1, 1)
    assert resumed["started"] == STEPS and resumed["step"] == STEPS + 1
    assert sorted(resumed["losses"]) == [str(STEPS + 1)]
    assert np.isfinite(resumed["losses"][str(STEPS + 1)])


@pytest.mark.slow
def test_a_job_whose_trainer_spans_two_hosts_stops_on_a_dead_host_and_resumes(
    tmp_path, tiny_mock_job, monkeypatch
):
    """``marinrl run`` with ``resources.trainer_hosts=2`` (2 simulated devices per process, Ray
    places both): the trainer spans 4 devices. SIGKILL host 1: the job stops with WORKER_LOST
    naming it; ``--resume`` goes on on both hosts, SIGTERM ends it with a final checkpoint
    written by both; a resume on one host finishes the run with every step logged once."""
    import signal

    from test_faults import _pid, _start_job, _train_steps, _wait_for

    from marin_rl_core.errors import ExitCode
    from marin_rl_core.learner.checkpoint import latest_checkpoint

    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=2")
    run_dir = tmp_path / "hosts"
    job = [*tiny_mock_job, "--set", "resources.trainer_hosts=2",
           "--set", "trainer.checkpoint_interval_steps=2"]  # fmt: skip
    proc = _start_job(tmp_path, "hosts", job, "--set", "trainer.num_train_steps=1000")
    _wait_for(proc, "a checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists())
    _wait_for(proc, "step 3", lambda: len(_train_steps(run_dir)) >= 3)
    assert "over 4 device(s)" in (run_dir / "logs" / "trainer.log").read_text()
    host = _pid(run_dir / "logs" / "trainer-1.log", "trainer host 1 of 2: process")
    assert host is not None
    os.kill(host, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.WORKER_LOST, stderr[-3000:]
    assert "trainer host 1 of 2 died" in stderr and "Traceback" not in stderr
    assert "2 of them share one machine" in stderr  # one node here: said, as a user would hear
    assert f"marinrl run --resume {run_dir}" in stderr
    kept = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())["step"]
    assert kept >= 2

    # Resumed on both hosts; SIGTERM once it trained past where the killed run got.
    before = max(_train_steps(run_dir))
    resumed = subprocess.Popen(
        [sys.executable, "-m", "marin_rl_core", "run", "--resume", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    _wait_for(resumed, "a step past the killed run's", lambda: max(_train_steps(run_dir)) > before)
    resumed.send_signal(signal.SIGTERM)
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == ExitCode.INTERRUPTED, stderr[-3000:]
    final = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())["step"]
    assert final == max(_train_steps(run_dir)) > before, "the stop's own checkpoint"
    assert "trainer host stopped at step" in (run_dir / "logs" / "trainer-1.log").read_text()

    # On one host (its 2 devices) to the end.
    done = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--resume", str(run_dir),
         "--set", "resources.trainer_hosts=1", "--set", f"trainer.num_train_steps={final + 1}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert _train_steps(run_dir) == list(range(1, final + 2))
