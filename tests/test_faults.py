"""Faults lose as little as possible: a bad problem, a diverging run, a Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

from marin_rl_core import EnvPlugin, ExitCode, Problem, build_registry, hookimpl
from marin_rl_core.checkpoint import latest_checkpoint
from marin_rl_core.config import resolve_config


@attrs.frozen
class FlakyConfig:
    pass


class FlakyEnv:
    """Poses ``k+k=`` problems; grading problem 3 raises, posing is fine."""

    def __init__(self, config: FlakyConfig):
        pass

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(n)]

    def score(self, problem, response):
        if problem.id == "3":
            raise RuntimeError("grader crashed on this one")
        return float(response.strip() == problem.answer)


class flaky_plugin:  # a plugin object, registered in code
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="flaky", summary="raises on problem 3", config_class=FlakyConfig, build=FlakyEnv
        )


def test_an_env_that_raises_on_one_problem_loses_that_problem_only(caplog):
    from marin_rl_core.rollout_manager import RolloutManager
    from marin_rl_core.tokenizer import model_tokenizer
    from marin_rl_core.trainer import initial_model

    registry = build_registry(modules=[flaky_plugin])
    config = resolve_config(registry, selections={"env": "flaky"}, overrides=["eval.n_examples=6"])
    tokenizer = model_tokenizer(config.model)
    manager = RolloutManager(
        config, registry, model=initial_model(config, tokenizer), tokenizer=tokenizer
    )
    batch, metrics = manager.sample_batch(
        "flaky", n_examples=6, n_generations=4, mode="train", seed=0, weight_step=7, worker_id="w"
    )
    assert metrics["env_errors"] == 1
    # A plain float score is the reward, with no score metrics beside it.
    assert not [k for k in metrics if k.startswith("score/")]
    assert sorted(g.rollouts[0].problem_id for g in batch.groups) == ["0", "1", "2", "4", "5"]
    assert all(len(g.rollouts) == 4 for g in batch.groups)
    assert all(r.metadata.weight_step == 7 and r.metadata.worker_id == "w" for r in batch.rollouts)
    assert "grader crashed on this one" in caplog.text

    # The manager keeps working after the error, and eval counts only the scored problems.
    stats, _ = manager.evaluate_lesson(
        "flaky", n_examples=6, eval_type="eval", seed=1, step=0, weight_step=0, worker_id="w"
    )
    assert stats.n_rollouts == 5 and stats.metrics == {}


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(cli, tmp_path, tiny_mock_job):
    result = cli(
        "run",
        *tiny_mock_job,
        "--set",
        f'run_dir="{tmp_path}"',
        "--run-id",
        "diverge",
        "--set",
        "trainer.num_train_steps=8",
        "--set",
        "trainer.checkpoint_interval_steps=1",
        # At this rate AdamW's decoupled weight decay alone (no reward signal is needed)
        # overflows the weights in one update, so the next loss is not finite.
        "--set",
        "trainer.learning_rate=1e30",
        "--set",
        "trainer.weight_decay=0.1",
        "--set",
        "trainer.warmup_steps=0",
        "--set",
        "trainer.max_grad_norm=0.0",
    )
    assert result.exit_code == ExitCode.FAILURE, result.output
    assert "training diverged at step" in result.output
    assert "last good checkpoint" in result.output
    checkpoint = latest_checkpoint(tmp_path / "diverge")
    assert checkpoint is not None
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    assert 1 <= step < 8
    assert f"(step {step})" in result.output


def test_ctrl_c_stops_cleanly_and_leaves_a_resumable_checkpoint(tmp_path, tiny_mock_job):
    run_dir = tmp_path / "interrupt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "marin_rl_core",
            "run",
            *tiny_mock_job,
            "--set",
            f'run_dir="{tmp_path}"',
            "--run-id",
            "interrupt",
            "--set",
            "trainer.num_train_steps=1000",
            "--set",
            "trainer.checkpoint_interval_steps=1000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"source": "train"' in metrics.read_text():
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INTERRUPTED, stderr
    assert "interrupted at step" in stderr and "Resume with" in stderr
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and (checkpoint / "model").is_dir()
    state = json.loads((checkpoint / "state.json").read_text())
    assert 1 <= state["step"] < 1000
    assert "curriculum" in state
    assert Path(run_dir / "config.toml").exists()
