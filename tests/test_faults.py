"""Faults lose as little as possible: a bad problem, a diverging run, a Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import attrs
import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl_core import EnvPlugin, ExitCode, LessonStats, Problem, build_registry, hookimpl
from marin_rl_core.config import resolve_config
from marin_rl_core.learner.checkpoint import latest_checkpoint
from marin_rl_core.learner.export import trained_model


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
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

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


class FlakyWriter:
    """Rollout storage whose first two writes fail after it stored the batch (a lost reply)."""

    def __init__(self):
        self.stored, self.calls = [], 0

    def write_batch(self, batch, *, timeout=None):
        self.calls += 1
        if batch not in self.stored:  # a storage that delivers each batch once
            self.stored.append(batch)
        if self.calls <= 2:
            raise ConnectionError("storage unreachable")


def flaky_worker(*overrides: str, writer=None, log=None):
    """A rollout worker of the flaky env with the default curriculum, outside any job (no
    weight client: weights of step 0 once it syncs)."""
    from marin_rl_core.rollout.worker import RolloutWorker

    registry = build_registry(modules=[flaky_plugin])
    config = resolve_config(registry, selections={"env": "flaky"}, overrides=list(overrides))
    curriculum = registry.get("curriculum", "default").build(
        config.curriculum.config, config.curriculum.lessons
    )
    kwargs = {} if log is None else {"log": log}
    return RolloutWorker(
        config,
        registry,
        worker_index=0,
        writer=writer,
        weight_client=None,
        curriculum=curriculum,
        **kwargs,
    )


def test_a_storage_write_error_is_retried_with_backoff_and_counted(caplog):
    writer = FlakyWriter()
    worker = flaky_worker(writer=writer)
    batch, _ = worker.manager.sample_batch(
        "flaky", n_examples=2, n_generations=2, mode="train", seed=0, weight_step=0, worker_id="w"
    )
    assert worker._write(batch) is True
    assert writer.calls == 3 and writer.stored == [batch], "the same batch, stored once"
    assert worker.counters()["write_errors"] == 2
    assert caplog.text.count("writing rollouts to storage failed") == 1, "logged once a minute"


def test_an_eval_in_which_every_problem_failed_reports_no_score():
    """Not a reward of 0.0: that would tell the curriculum the lesson was forgotten."""
    logged: list[dict] = []
    worker = flaky_worker(
        "eval.n_examples=1",
        'curriculum.lessons=[{id = "flaky", stop_threshold = 0.5}]',
        log=lambda metrics, *, step, source: logged.append(metrics),
    )
    curriculum = worker.curriculum
    curriculum.update_eval(LessonStats(lesson_id="flaky", mean_reward=1.0, n_rollouts=8, step=0))
    assert curriculum.lesson_states() == {"flaky": "graduated"}
    # The built env, inside the one-step adapter the rollout side wraps single-turn envs in.
    worker.manager.env("flaky").env.score = lambda problem, response: 1 / 0  # every grade fails
    metrics = worker.evaluate()
    assert metrics["eval/flaky/n"] == 0
    assert "eval/flaky/reward" not in metrics
    assert curriculum.lesson_states() == {"flaky": "graduated"}
    assert curriculum.state_dict()["eval_history"]["flaky"] == [1.0]


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
        # overflows the weights in one update. The warmup starts at a learning rate of 0, so
        # step 1 is good; step 2's update overflows while its loss is still finite.
        "--set",
        "trainer.learning_rate=1e30",
        "--set",
        "trainer.weight_decay=0.1",
        "--set",
        "trainer.warmup_steps=2",
        "--set",
        "trainer.max_grad_norm=0.0",
    )
    assert result.exit_code == ExitCode.FAILURE, result.output
    assert "training diverged at step" in result.output
    assert "last good checkpoint" in result.output and "marinrl run --resume" in result.output
    checkpoint = latest_checkpoint(tmp_path / "diverge")
    assert checkpoint is not None
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    assert 1 <= step < 8
    assert f"(step {step})" in result.output
    # The kept checkpoint is good: every parameter finite (the blown-up update was not saved).
    model = trained_model(tmp_path / "diverge", build_registry())[0]
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    assert leaves and all(bool(np.isfinite(np.asarray(x)).all()) for x in leaves)


def _sigint_as_in_a_terminal() -> None:
    """A shell's background job (`.ci/run &`, `nohup ... &`) hands its children SIGINT ignored;
    a user's terminal does not. The job under test gets the terminal's default, as Ctrl-C
    meets it (a test run started in the background failed without it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
        preexec_fn=_sigint_as_in_a_terminal,
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


# --- the fault battery: real processes, real Ray ---------------------------------------------


def _start_job(tmp_path: Path, run_id: str, job: list[str], *extra: str) -> subprocess.Popen:
    """``marinrl run`` in its own process, as a user runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "marin_rl_core", "run", *job]
        + ["--set", f'run_dir="{tmp_path}"', "--run-id", run_id, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(proc: subprocess.Popen, what: str, condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended before {what}:\n{err[-3000:]}")
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}: {proc.communicate()[1][-3000:]}")


def _train_steps(run_dir: Path) -> list[int]:
    from marin_rl_core.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r["step"] for r in read_metrics(run_dir) if r["source"] == "train"]


def _pid(log: Path, pattern: str) -> int | None:
    import re

    if not log.exists():
        return None
    found = re.findall(pattern + r" (\d+)", log.read_text())
    return int(found[-1]) if found else None


def _kill_rollout_worker_0_after_a_step(
    tmp_path: Path, run_id: str, job: list[str], *extra: str
) -> tuple[int, str]:
    """Start ``marinrl run``, SIGKILL rollout worker 0 after the first training step, and wait
    for the job to end well; returns the killed process id and the job's stderr."""
    run_dir = tmp_path / run_id
    proc = _start_job(tmp_path, run_id, job, *extra)
    _wait_for(proc, "the first training step", lambda: len(_train_steps(run_dir)) >= 1)
    first = _pid(run_dir / "logs" / "rollout-0.log", "rollout worker 0 process")
    assert first is not None
    os.kill(first, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    return first, stderr


@pytest.mark.parametrize("weights", ["arrow_flight", pytest.param("jax", marks=pytest.mark.slow)])
def test_a_killed_rollout_worker_is_restarted_and_the_job_finishes(
    tmp_path, tiny_mock_job, weights
):
    """With each weight transfer plugin: the restarted worker receives weights again, and each
    receive's bytes, seconds, GB/s and version lag are in the rollout rows."""
    run_dir = tmp_path / "restart"
    log = run_dir / "logs" / "rollout-0.log"
    first, stderr = _kill_rollout_worker_0_after_a_step(
        tmp_path, "restart", tiny_mock_job, "--weight-transfer", weights,
        "--set", "trainer.num_train_steps=40",
        "--set", "faults.restart_backoff_s=0.1", "--set", "logging.samples_per_step=32",
        # On-policy, so the job lasts (~0.1 s a step) until the killed worker is back: with
        # warm compile caches twelve off-policy steps took 0.3 s, done before the kill landed.
        "--set", "replay_buffer.max_rollout_step_delay=0",
    )  # fmt: skip
    assert "constructor arguments in the object store" not in stderr  # Ray's restart caveat
    steps = _train_steps(run_dir)
    assert steps == list(range(1, 41)), "every step trained once, none twice"
    # No rollout trained twice: no rollout batch (4 problems x 8 samples) gives more than its
    # 32 rollouts to training (a worker process's batches are told apart by its worker_id).
    from collections import Counter

    per_batch = Counter(
        (row["worker_id"], row["batch"])
        for row in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())
    )
    assert max(per_batch.values()) <= 32, "a rollout was trained on twice"
    second = _pid(log, "rollout worker 0 process")
    assert second is not None and second != first, "a new process took over"
    assert "restarted after its process died" in log.read_text()
    # A local job's processes run at the user's own priority (Ray starts its workers at
    # niceness 15 unless told otherwise), the restarted one too.
    import re

    ours = os.nice(0)
    assert (
        re.findall(r"rollout worker 0 process \d+ .*, niceness (\d+)", log.read_text())
        == [str(ours)] * 2
    )
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert re.findall(r"trainer process \d+ .*, niceness (\d+)", trainer_log) == [str(ours)]
    driver = (run_dir / "driver.log").read_text()
    assert f"rollout worker 0 died (process {first}); restart 1 of 3" in driver
    from marin_rl_core.metrics import read_metrics

    restarts = [r for r in read_metrics(run_dir) if "faults/rollout_worker_restarts" in r]
    assert restarts and restarts[-1]["faults/rollout_worker_restarts"] == 1
    receives = [r for r in read_metrics(run_dir) if "rollout/weights_bytes" in r]
    assert len(receives) >= 2 and all(r["rollout/weights_bytes"] > 0 for r in receives)
    assert all(r["rollout/weights_gb_per_s"] > 0 for r in receives)
    assert all(r["rollout/weights_lag_steps"] >= 0 for r in receives)


@pytest.mark.slow
def test_a_rollout_worker_killed_while_setting_up_is_restarted_counted_and_logged(
    tmp_path, tiny_mock_job
):
    """SIGKILL rollout worker 0 before its sampler has warmed up: Ray restarts it, the job
    finishes, and the restart is in driver.log and the restart counter like any other."""
    run_dir = tmp_path / "setup-dies"
    log = run_dir / "logs" / "rollout-0.log"
    proc = _start_job(
        tmp_path, "setup-dies", tiny_mock_job, "--set", "trainer.num_train_steps=3",
        "--set", "faults.restart_backoff_s=0.1",
    )  # fmt: skip
    _wait_for(proc, "rollout worker 0's process", lambda: _pid(log, "rollout worker 0 process"))
    first = _pid(log, "rollout worker 0 process")
    os.kill(first, signal.SIGKILL)
    assert "sampler warmed up" not in log.read_text(), "the kill came after set-up"
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert _train_steps(run_dir) == [1, 2, 3]
    second = _pid(log, "rollout worker 0 process")
    assert second is not None and second != first, "a new process took over"
    driver = (run_dir / "driver.log").read_text()
    assert (
        f"rollout worker 0 died while setting up (process {first}); restart 1 of 3 "
        f"(process {second})" in driver
    ), driver[-3000:]
    from marin_rl_core.metrics import read_metrics

    restarts = [r for r in read_metrics(run_dir) if "faults/rollout_worker_restarts" in r]
    assert restarts and restarts[-1]["faults/rollout_worker_restarts"] == 1


@pytest.mark.slow
def test_a_rollout_worker_restarted_at_the_end_evaluates_the_final_weights(tmp_path, tiny_mock_job):
    """Rollout worker 0 runs the final eval. Killed mid-run and restarted with a long backoff,
    it has not had its run (nor a connection to the trainer) when training ends: it still
    evaluates the final weights, promptly, and the eval is logged at the final step (it used
    to wait 600 s for weights it could not get, then score its initial weights)."""
    run_dir = tmp_path / "late"
    _kill_rollout_worker_0_after_a_step(
        tmp_path, "late", tiny_mock_job, "--set", "num_rollout_workers=2",
        "--set", "trainer.num_train_steps=8", "--set", "faults.restart_backoff_s=300",
    )  # fmt: skip
    from marin_rl_core.metrics import read_metrics

    evals = [r for r in read_metrics(run_dir) if r["source"] == "eval"]
    assert evals[-1]["step"] == 8 and "eval/mock/reward" in evals[-1], evals[-1]
    assert "no final eval" not in (run_dir / "driver.log").read_text()


@pytest.mark.slow
def test_a_rollout_worker_killed_in_the_last_steps_is_counted_and_logged(tmp_path, tiny_mock_job):
    """SIGKILL rollout worker 1 one step before the end: worker 0 feeds the last step, the job
    finishes before Ray has the worker back, and its death is still in driver.log and the
    restart counter (it used to be neither)."""
    run_dir = tmp_path / "last"
    log = run_dir / "logs" / "rollout-1.log"
    proc = _start_job(
        tmp_path, "last", tiny_mock_job, "--set", "num_rollout_workers=2",
        "--set", "trainer.num_train_steps=6",
    )  # fmt: skip
    _wait_for(proc, "step 5", lambda: len(_train_steps(run_dir)) >= 5)
    pid = _pid(log, "rollout worker 1 process")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    driver = (run_dir / "driver.log").read_text()
    assert f"rollout worker 1 died in the last steps (process {pid}); restart 1 of 3" in driver, (
        driver[-3000:]
    )
    from marin_rl_core.metrics import read_metrics

    restarts = [r for r in read_metrics(run_dir) if "faults/rollout_worker_restarts" in r]
    assert restarts and restarts[-1]["faults/rollout_worker_restarts"] == 1


def _problems_by_batch(run_dir: Path, after: int = 0) -> dict[int, set[str]]:
    """The problems of worker 0's batch k that were trained on after step ``after`` (every
    trained rollout is in samples.jsonl with its worker and batch counter)."""
    found: dict[int, set[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] > after and row["worker"] == 0:
            found.setdefault(row["batch"], set()).add(row["problem"])
    return found


def _drawn(batch: int) -> set[str]:
    """The problems worker 0's batch ``batch`` draws in the tiny mock job (seed 0, 4 prompts)."""
    from marin_rl_core.rollout.worker import batch_seed

    registry = build_registry()
    config = resolve_config(registry, selections={"env": "mock"})
    env = registry.get("env", "mock").build(config.env.config)
    return {p.id for p in env.sample_problems(4, mode="train", seed=batch_seed(0, 0, batch))}


def test_a_killed_trainer_stops_the_job_and_resume_goes_on_from_anywhere(tmp_path, tiny_mock_job):
    """SIGKILL the trainer; --resume (from another directory) goes on from the checkpoint with
    its replay buffer and each rollout worker's batch counter: after the resume it draws the
    same problems as an uninterrupted run, and the metrics have each step once."""
    run_dir = tmp_path / "trainer-dies"
    # Every trained rollout goes to samples.jsonl, with its worker and batch counter.
    job = [*tiny_mock_job, "--set", "logging.samples_per_step=32"]
    proc = _start_job(
        tmp_path, "trainer-dies", job, "--set", "trainer.num_train_steps=1000",
        "--set", "trainer.checkpoint_interval_steps=2",
    )  # fmt: skip
    _wait_for(proc, "a checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists())
    _wait_for(proc, "step 3", lambda: len(_train_steps(run_dir)) >= 3)
    trainer = _pid(run_dir / "logs" / "trainer.log", "trainer process")
    assert trainer is not None
    os.kill(trainer, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.WORKER_LOST, stderr[-3000:]
    assert "the trainer process died" in stderr and "Traceback" not in stderr
    assert f"marinrl run --resume {run_dir}" in stderr
    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    kept, position = state["step"], state["rollout_positions"]["0"]
    assert kept >= 2 and kept % 2 == 0
    assert position >= kept, "the checkpoint knows how far worker 0's batches were read"

    # Resumed from another directory: the run goes on in its own directory, not a new one.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--resume", str(run_dir),
         "--set", f"trainer.num_train_steps={kept + 3}"],
        capture_output=True, text=True, cwd=elsewhere, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list(elsewhere.iterdir()), "nothing is written where the command ran"
    steps = _train_steps(run_dir)
    assert steps == list(range(1, kept + 4)), "metrics continue without duplicate steps"
    # samples.jsonl too: each step's rollouts once (32 per step in this job), none of the steps
    # the dead run trained after its checkpoint.
    sampled = Counter(json.loads(line)["step"] for line in (run_dir / "samples.jsonl").open())
    assert sorted(sampled) == steps and len(set(sampled.values())) == 1, sampled
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()

    # After the resume, worker 0 goes on at the batch after the last one the checkpoint had
    # read (none drawn twice), and batch k poses what batch k poses in any run of this config,
    # an uninterrupted one included.
    after_resume = _problems_by_batch(run_dir, after=kept)
    assert after_resume and min(after_resume) >= position, (position, sorted(after_resume))
    for batch, problems in after_resume.items():
        assert problems <= _drawn(batch), f"batch {batch} posed other problems"

    # The batches trained before the kill, by the run while nobody had interrupted it, posed
    # what _drawn says for their counters too: the resumed run draws what an uninterrupted run
    # of this config draws.
    before_kill = {b: p for b, p in _problems_by_batch(run_dir).items() if b < position}
    assert before_kill, sorted(_problems_by_batch(run_dir))
    for batch, problems in before_kill.items():
        assert problems <= _drawn(batch), f"batch {batch} posed other problems before the kill"


@pytest.mark.parametrize(
    "group",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["to-marinrl", "to-its-process-group"],
)
def test_sigterm_stops_cleanly_with_a_checkpoint(tmp_path, tiny_mock_job, group):
    """SIGTERM to `marinrl run`, or to its whole process group as Slurm's scancel and Kubernetes
    send it (then the Ray processes get it too): a final checkpoint either way."""
    run_dir = tmp_path / "term"
    proc = _start_job(
        tmp_path, "term", tiny_mock_job, "--set", "trainer.num_train_steps=1000",
        "--set", "trainer.checkpoint_interval_steps=1000",
    )  # fmt: skip
    _wait_for(proc, "the first training step", lambda: len(_train_steps(run_dir)) >= 1)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)  # the job leads its own session (_start_job)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INTERRUPTED, stderr[-3000:]
    assert f"marinrl run --resume {run_dir}" in stderr
    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    assert 1 <= state["step"] < 1000


@pytest.fixture(scope="module")
def two_step_run(cli, tiny_mock_job, tmp_path_factory):
    """A finished 2-step run with a checkpoint after each step (and what `marinrl run` printed,
    progress bar on as by default); each test resumes its own copy (a run goes on wherever it
    was moved)."""
    runs = tmp_path_factory.mktemp("runs")
    result = cli(
        "run", *tiny_mock_job, "--set", "trainer.checkpoint_interval_steps=1",
        "--set", f'run_dir="{runs}"', "--run-id", "two", "--set", "trainer.num_train_steps=2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return runs / "two", result.output


def _copy_of(run: Path, where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, where / run.name))


def test_the_trainer_and_the_rollout_worker_are_forked_from_the_jobs_fork_server(two_step_run):
    """A local job's workers are forked from the server that imported JAX, levanter and Ray
    once for the job (marin_rl_core/job/worker_fork.py), and their logs say so."""
    logs = two_step_run[0] / "logs"
    for name in ("trainer.log", "rollout-0.log"):
        first = (logs / name).read_text().splitlines()[0]
        assert "forked from the job's fork server (process " in first, first


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(cli, tmp_path, two_step_run):
    run_dir = _copy_of(two_step_run[0], tmp_path)
    newest = run_dir / "checkpoints" / "step-000002"
    # A truncated array: every file of the model's embedding table cut to nothing.
    arrays = [p for p in (newest / "model").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert arrays
    for path in arrays:
        path.write_bytes(b"")

    evaluated = cli("eval", str(run_dir), "--n-examples", "4", "--json")
    assert evaluated.exit_code == 0, evaluated.output
    assert "step-000002" in evaluated.output and "skipped" in evaluated.output
    assert "evaluated step-000001 instead" in evaluated.output
    assert "Traceback" not in evaluated.output and "resumed from" not in evaluated.output
    assert json.loads(evaluated.stdout[evaluated.stdout.index("{") :])["step"] == 1

    resumed = cli("run", "--resume", str(run_dir), "--set", "trainer.num_train_steps=3")
    assert resumed.exit_code == 0, resumed.output
    assert "damaged and was skipped; resumed from step-000001" in resumed.output
    assert _train_steps(run_dir) == [1, 2, 3]


def test_a_late_event_loop_is_closed_report_stays_off_the_console(tmp_path):
    """Issue 51: after a damaged checkpoint, TensorStore reads still in flight finish on its
    threads and find their event loop closed; Python reports that as an unraisable exception,
    a bare traceback on the console of ``marinrl eval`` (once in four under load). The
    ``marinrl`` command routes exactly those to the log; any other unraisable exception is
    still reported."""
    code = (
        "import logging, sys\n"
        "from marin_rl_core.cli import main\n"
        "logging.basicConfig(filename=sys.argv[1], level=logging.DEBUG)\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        raise RuntimeError('Event loop is closed')\n"
        "class Bug:\n"
        "    def __del__(self):\n"
        "        raise ValueError('a real bug')\n"
        "sys.argv = ['marinrl', 'plugins', 'list', '--kind', 'loss']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "Late(); Bug()\n"
    )
    log = tmp_path / "run.log"
    result = subprocess.run(
        [sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120
    )
    assert "rloo" in result.stdout, result.stderr  # the command ran
    assert "Event loop is closed" not in result.stderr
    assert "ValueError: a real bug" in result.stderr
    assert "Event loop is closed" in log.read_text()


def test_a_resume_that_changes_the_models_shape_is_refused_and_the_run_kept(
    cli, tmp_path, two_step_run
):
    """`--resume RUN --set model.hidden_dim=128` cannot load RUN's checkpoints: it is refused
    before anything is written, naming the setting, and the run stays resumable as it was."""
    run_dir = _copy_of(two_step_run[0], tmp_path)
    assert "train:" in two_step_run[1]  # the progress bar, on by default
    saved = (run_dir / "config.toml").read_bytes()
    log = (run_dir / "driver.log").read_bytes()
    for change, named in (
        ("model.hidden_dim=128", "model.hidden_dim: 64 -> 128"),
        ('trainer.precision="bf16-params"', "trainer.precision: 'auto' -> 'bf16-params'"),
        ("model.lora.rank=8", "model.lora.rank: 0 -> 8"),  # adapters the checkpoints lack
    ):
        refused = cli("run", "--resume", str(run_dir), "--set", change)
        assert refused.exit_code == ExitCode.CONFIG, refused.output
        assert named in refused.output and "The saved run is unchanged" in refused.output
        assert "damaged" not in refused.output
        assert (run_dir / "config.toml").read_bytes() == saved
        assert (run_dir / "driver.log").read_bytes() == log
    # A change that keeps the checkpoints loadable still resumes (and is saved).
    resumed = cli(
        "run", "--resume", str(run_dir), "--set", "trainer.num_train_steps=3",
        "--set", "logging.progress=false",
    )  # fmt: skip
    assert resumed.exit_code == 0, resumed.output
    assert "train:" not in resumed.output  # logging.progress=false: no bar
    assert _train_steps(run_dir) == [1, 2, 3]
    assert "num_train_steps = 3" in (run_dir / "config.toml").read_text()


def test_a_job_that_cannot_make_progress_is_stopped_by_the_watchdog(cli, tmp_path):
    """Every prompt is too long for model.max_seq_len: nothing reaches the trainer. The job
    stops as soon as the first batches of every worker were all dropped (not after
    faults.stall_timeout_s, here raised to 300 s) and says why, with the resume command."""
    result = cli(
        "run", "--env", "math",
        "--set", 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        "--set", "model.max_seq_len=4", "--set", "sampling.max_tokens=2",
        "--set", "eval.sampling.max_tokens=2", "--set", "eval.n_examples=4",
        "--set", "faults.stall_timeout_s=300",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "stalled",
    )  # fmt: skip
    assert result.exit_code == ExitCode.STALLED, result.output
    assert "every problem of the first 3 batches of each rollout worker was dropped" in (
        " ".join(result.output.split())
    )
    assert "no training step completed for" not in result.output
    assert f"resume with `marinrl run --resume {tmp_path / 'stalled'}`" in result.output
    assert "prompts longer than 3 tokens" in result.output
    assert "model.max_seq_len" in result.output and "Traceback" not in result.output
    rows = (tmp_path / "stalled" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) < 2000, "the rollout side does not flood the metrics while stalled"


@pytest.mark.parametrize("weights", ["arrow_flight", pytest.param("jax", marks=pytest.mark.slow)])
def test_a_weight_server_the_workers_cannot_reach_is_named_by_the_watchdog(
    cli, tmp_path, tiny_mock_job, weights
):
    """The trainer advertises an address where nothing answers (127.0.0.2: loopback, but the
    servers bind 127.0.0.1): workers retry with backoff, and the watchdog says why no step
    completes."""
    result = cli("run", *tiny_mock_job, "--weight-transfer", weights,
                 "--set", 'weight_transfer.advertise_host="127.0.0.2"',
                 "--set", "faults.stall_timeout_s=15", "--set", "faults.stop_timeout_s=10",
                 "--set", f'run_dir="{tmp_path}"', "--run-id", "unreachable")  # fmt: skip
    assert result.exit_code == ExitCode.STALLED, result.output
    text = " ".join(result.output.split())
    assert "the rollout workers cannot receive weights from the trainer's weight server" in text
    assert "127.0.0.2" in text and "Traceback" not in result.output
    log = (tmp_path / "unreachable" / "logs" / "rollout-0.log").read_text()
    assert "receiving weights failed" in log and "trying again in" in log


@pytest.mark.slow
def test_a_loss_that_drops_every_group_stops_the_job_naming_the_option(
    cli, tiny_mock_job, tmp_path
):
    """grpo with drop_zero_variance_groups and one sample per problem: every group is dropped,
    the workers regenerate in vain, and the watchdog stops the job (exit 12) saying which
    option does it, not a bare "no step completed"."""
    result = cli(
        "run", *tiny_mock_job, "--loss", "grpo", "--set", "sampling.n_prompts=32",
        "--set", "sampling.n_generations_per_prompt=1",
        "--set", "loss.drop_zero_variance_groups=true", "--set", "faults.stall_timeout_s=15",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "dropped",
    )  # fmt: skip
    assert result.exit_code == ExitCode.STALLED, result.output
    said = " ".join(result.output.split())
    assert "the loss dropped every group that arrived" in said
    assert "loss.drop_zero_variance_groups" in said and "Traceback" not in result.output


BROKEN_ENV = """
import threading

import attrs

from marin_rl_core import EnvPlugin, Problem, hookimpl


@attrs.frozen
class BrokenConfig:
    fault: str = "raise"


class Episode:
    def __init__(self, fault):
        self.fault = fault

    def step(self, action):
        if self.fault == "raise":
            raise ConnectionError("the sandbox is gone")
        threading.Event().wait()  # hangs for good


class BrokenEnv:
    def __init__(self, config):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=f"{seed}-{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(n)]

    def reset(self, problem):
        return Episode(self.config.fault)


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(name="broken", summary="a step that fails", config_class=BrokenConfig,
                    build=BrokenEnv)
"""


def _run_with_plugin(
    tmp_path: Path, module: str, *args: str, timeout: float
) -> subprocess.CompletedProcess:
    """``marinrl run --plugin MODULE ARGS`` as a user runs it, ``MODULE`` written in
    ``tmp_path`` (on the child's ``PYTHONPATH``)."""
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--plugin", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.mark.parametrize("fault", ["raise", pytest.param("hang", marks=pytest.mark.slow)])
def test_an_env_whose_every_step_fails_stops_the_job_at_once_saying_why(
    tmp_path, tiny_mock_job, fault
):
    """A third-party multi-turn env whose `step` always raises, or always hangs: the job stops
    after the first batches of each worker (not after faults.stall_timeout_s, here 600 s) with
    exit 12 and the cause, and the env's traceback is in the rollout worker's log. A hung step
    holds up neither the sampler's warm-up nor the stop."""
    (tmp_path / "brokenenv.py").write_text(BROKEN_ENV)
    job = [arg if arg != "mock" else "broken" for arg in tiny_mock_job]
    run_dir = tmp_path / "broken"
    result = _run_with_plugin(
        tmp_path, "brokenenv", *job, "--set", f'env.fault="{fault}"',
        "--set", "episodes.step_timeout_s=2", "--set", "faults.stall_timeout_s=600",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "broken", timeout=400,
    )  # fmt: skip
    out = " ".join(result.stderr.split())
    assert result.returncode == ExitCode.STALLED, result.stderr[-3000:]
    assert "every problem of the first 3 batches of each rollout worker was dropped" in out, out
    assert "no training step completed for" not in out
    assert f"resume with `marinrl run --resume {run_dir}`" in out
    assert "Traceback" not in result.stderr
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "sampler warmed up" in rollout_log
    if fault == "raise":
        assert "the sandbox is gone" in out, out  # the env's own error, quoted
        assert "Traceback" in rollout_log and 'brokenenv.py", line' in rollout_log
    else:
        assert "episodes cut off by env timeouts" in out, out
        assert "episodes.step_timeout_s" in out


def test_ctrl_c_while_env_steps_hang_stops_without_waiting_for_their_timeout(tmp_path):
    """Every env step hangs and may take 600 s: the sampler still warms up (its env calls are
    cut off early), and Ctrl-C stops the job (exit 130, resumable) without waiting for the
    hung steps: the batch being sampled is cancelled."""
    (tmp_path / "brokenenv.py").write_text(BROKEN_ENV)
    run_dir = tmp_path / "hung"
    log = run_dir / "logs" / "rollout-0.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "marin_rl_core", "run", "--plugin", "brokenenv", "--env", "broken",
         "--set", "trainer.batch_size=32", "--set", "sampling.n_prompts=4",
         "--set", 'env.fault="hang"', "--set", "episodes.step_timeout_s=600",
         "--set", f'run_dir="{tmp_path}"', "--run-id", "hung"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                           os.environ.get("PYTHONPATH", "")])},
        preexec_fn=_sigint_as_in_a_terminal,
    )  # fmt: skip
    _wait_for(proc, "the first batch", lambda: log.exists() and "now sampling" in log.read_text())
    assert "sampler warmed up" in log.read_text()
    time.sleep(1.0)  # the first batch's steps are hanging
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)  # far less than the steps' 600 s timeout
    assert proc.returncode == ExitCode.INTERRUPTED, stderr[-3000:]
    assert f"marinrl run --resume {run_dir}" in stderr and "Traceback" not in stderr
    assert "the batch being sampled was cancelled" in log.read_text()


@pytest.mark.slow
def test_the_watchdog_counts_steps_not_logged_rows(cli, tmp_path, tiny_mock_job):
    """Train rows are logged every logging.log_every steps: with it raised (as users do for long
    runs), a healthy job whose steps are each far quicker than faults.stall_timeout_s, but which
    logs its first row only after it, must not be stopped as stalled."""
    result = cli(
        "run", *tiny_mock_job,
        "--set", "trainer.num_train_steps=400", "--set", "logging.log_every=1000",
        "--set", "replay_buffer.max_rollout_step_delay=0",  # on-policy: ~0.1 s a step here
        "--set", "trainer.checkpoint_interval_steps=1000", "--set", "faults.stall_timeout_s=8",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _train_steps(tmp_path / "quiet") == [400]


def test_an_unreachable_ray_address_fails_fast_and_writes_nothing(cli, tmp_path, tiny_mock_job):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    result = cli(
        "run", *tiny_mock_job, "--ray-address", f"127.0.0.1:{port}",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "nowhere",
    )  # fmt: skip
    assert result.exit_code == ExitCode.CLUSTER, result.output
    assert f"nothing answers at 127.0.0.1:{port}" in result.output
    assert "ray start --head" in result.output
    assert time.monotonic() - start < 60
    assert not (tmp_path / "nowhere").exists()
    assert "writing to" not in result.output, "nothing was written: the run is not announced"


def test_a_local_ray_that_does_not_start_says_where_its_logs_are(
    cli, tmp_path, tiny_mock_job, monkeypatch
):
    """Ray's own start-up failing (its raylet timed out: a machine short of memory, a dashboard
    agent that died) is exit 10 naming Ray's logs and what to try, not "a marinrl bug"; nothing
    is written."""
    from marin_rl_core.job.local_ray import LocalRay

    def fails(self, num_cpus):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(LocalRay, "_init_ray", fails)
    result = cli(
        "run", *tiny_mock_job, "--set", f'run_dir="{tmp_path}"', "--run-id", "no-ray",
    )  # fmt: skip
    out = " ".join(result.output.split())
    assert result.exit_code == ExitCode.CLUSTER, result.output
    assert "the job's local Ray did not start: Exception: The current node timed out" in out
    assert "ray/session_latest/logs (raylet.out" in out and "--ray-address" in out
    assert "marinrl bug" not in out and "Traceback" not in result.output
    assert not (tmp_path / "no-ray").exists()


def test_a_run_dir_that_cannot_be_written_says_so(cli, tmp_path, tiny_mock_job, monkeypatch):
    """Said before the job starts Ray and its workers (seconds on a small machine), as what a
    write would meet: a file where a directory of the path should be."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a run directory that cannot be written")

    monkeypatch.setattr(ray, "init", no_ray)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for run_dir in (blocker, blocker / "runs"):
        result = cli("run", *tiny_mock_job, "--set", f'run_dir="{run_dir}"', "--run-id", "x")
        assert result.exit_code == ExitCode.RUN_DIR, result.output
        out = " ".join(result.output.split())
        assert f"cannot write {blocker}" in out and "a file is in the way" in out, out
        assert "Traceback" not in result.output
    assert blocker.read_text() == "not a directory"


def test_resume_needs_a_run_directory(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("run", "--resume", str(tmp_path))
    assert result.exit_code == ExitCode.CONFIG
    assert "not a run directory" in result.output
    # A directory that does not exist (a typo) is named as such, by `eval` and `export` too.
    missing = tmp_path / "runs" / "rl-typo"
    for command in (["run", "--resume"], ["eval"], ["export"]):
        result = cli(
            *command, str(missing), *([str(tmp_path / "out")] if command == ["export"] else [])
        )
        assert result.exit_code == ExitCode.CONFIG, (command, result.output)
        assert f"{missing}: no such directory" in result.output, (command, result.output)
        assert "Traceback" not in result.output
    # `eval` says so before loading anything, and leaves no log file where it was typed.
    assert not (tmp_path / "logs").exists()
    (tmp_path / "config.toml").write_text("")
    result = cli("run", "--resume", str(tmp_path), "--config", str(tmp_path / "config.toml"))
    assert result.exit_code == ExitCode.CONFIG
    assert "leave out --config" in result.output


def _run_without(module: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``marinrl ARGS`` in a process where ``module`` cannot be imported (not installed)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        f"sys.argv = ['marinrl', *{list(args)!r}]\n"
        "from marin_rl_core.cli.app import main\nmain()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )


def test_what_an_env_can_check_cheaply_is_checked_before_the_job_starts(cli, tmp_path):
    """A data file that does not exist, an optional package not installed: exit 3 at once,
    nothing written (was: found by the workers after start, exit 1 after ~2 minutes, a run
    directory with a step-0 checkpoint and a resume command for a run that never trained)."""
    result = cli(
        "run", "--env", "math", "--set", "env.task=file", "--set", "env.data_path=nope.jsonl",
        "--set", f'run_dir="{tmp_path}"',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "env.data_path 'nope.jsonl' does not exist" in result.output
    assert "--resume" not in result.output and not list(tmp_path.iterdir())
    done = _run_without(
        "reasoning_gym", tmp_path, "run", "--env", "reasoning_gym", "--set", f'run_dir="{tmp_path}"'
    )
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "pip install 'marin-rl[reasoning]'" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


def test_a_run_directory_on_s3_without_s3fs_says_what_to_install(tmp_path):
    """`run_dir=s3://...` where s3fs is not installed: exit 11 before anything starts, naming
    the extra to install (was exit 1, "unexpected ImportError ... a marinrl bug")."""
    done = _run_without(
        "s3fs", tmp_path, "run", "--storage", "gcs", "--env", "mock",
        "--set", 'run_dir="s3://bucket/runs"',
    )  # fmt: skip
    assert done.returncode == ExitCode.RUN_DIR, done.stderr
    assert "cannot use the run directory s3://bucket/runs" in done.stderr
    assert "pip install 'marin-rl[s3]'" in done.stderr and "marinrl bug" not in done.stderr
    assert not list(tmp_path.iterdir())


LOOPBACK_PROBE = """
import json, os, sys
import psutil, ray
from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.job.driver import RLJob

registry = build_registry()
job = RLJob(resolve_config(registry, selections={"env": "mock"}), registry)
assert job._start_ray()

@ray.remote
class Probe:
    def pid(self):
        return os.getpid()

ray.get(Probe.remote().pid.remote())  # a worker process too
session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
me = psutil.Process()
procs = {p.pid: p for p in me.children(recursive=True)}
for p in psutil.process_iter(["cmdline"]):
    if session in " ".join(p.info["cmdline"] or []):
        procs[p.pid] = p
listening = set()
commands = []
for p in [me, *procs.values()]:
    try:  # a short-lived worker process may have exited since it was listed
        connections = p.net_connections(kind="inet")
        if p is not me:
            commands.append(" ".join(p.cmdline()))
    except psutil.NoSuchProcess:
        continue
    for c in connections:
        if c.status == psutil.CONN_LISTEN:
            listening.add(c.laddr.ip)
from ray._private.node import Node
from ray._private import utils
restored = all(getattr(Node, name).__name__ == name
               for name in ("start_monitor", "start_api_server", "start_log_monitor"))
restored = restored and utils.get_dashboard_dependency_error.__module__ == utils.__name__
from ray._private import services
name = "_build_python_executable_command_memory_profileable"
restored = restored and getattr(getattr(services, name), "__name__", None) == name
import time
session_dir = ray._private.worker._global_node.get_session_dir_path()
log = os.path.join(session_dir, "logs", "dashboard_agent.log")
agent_modules = None
for _ in range(600):  # what the agent says once it has loaded its modules
    text = open(log).read() if os.path.exists(log) else ""
    if "Loaded " in text:
        agent_modules = text.split("Loaded ")[1].split(" modules")[0]
        break
    time.sleep(0.1)
job._stop_ray()
print(json.dumps({"listening": sorted(listening), "auth": os.environ.get("RAY_AUTH_MODE"),
                  "commands": commands, "restored": restored, "agent_modules": agent_modules}))
"""


def test_the_local_ray_listens_on_loopback_only_and_shows_no_token_notice():
    """...and starts no API server, autoscaler monitor or log monitor: a one-node job whose
    workers log to the run directory needs none, and starting them took ~4 s of its start-up
    (issue 11); the raylet's dashboard agent runs without the modules that serve them."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.run(
        [sys.executable, "-c", LOOPBACK_PROBE], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["listening"], "no listening socket found: the probe is broken"
    assert set(found["listening"]) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, found
    assert found["auth"] is None, "RAY_AUTH_MODE is given back after the job"
    assert "Token authentication" not in proc.stderr
    commands = "\n".join(found["commands"])
    assert "raylet" in commands and "gcs_server" in commands, commands
    # (the agent renames its process: the raylet's command line has the agent's)
    (raylet,) = [c for c in found["commands"] if "--dashboard_agent_command=" in c]
    agent = raylet.split("--dashboard_agent_command=")[1].split(" --runtime_env_agent_command")[0]
    assert "dashboard/agent.py" in agent and "--minimal" in agent.split(), agent
    # ...through marinrl's script, which has it load the modules a minimal Ray install's agent
    # loads (none: levanter installs the dashboard's packages, and the agent ran seven).
    assert agent.split()[2].endswith("marin_rl_core/job/ray_agent_start.py"), agent
    assert found["agent_modules"] == "0", found["agent_modules"]
    # Its workers start through marinrl's start-up script (which forks them from the job's fork
    # server), not Ray's own set-up script.
    worker = raylet.split("--python_worker_command=")[1].split(" --")[0]
    assert "marin_rl_core/job/ray_worker_start.py" in worker, worker
    for extra in (
        "ray/dashboard/dashboard.py",
        "ray/autoscaler/_private/monitor.py",
        "ray/_private/log_monitor.py",
    ):
        assert extra not in commands, commands
    assert found["restored"], "Ray's Node methods are put back after the job's ray.init"


def test_a_full_disk_stops_the_job_with_what_to_do(tmp_path, tiny_mock_job):
    """The run directory's disk fills up while the job runs: the job stops with exit 11 and a
    message that names the problem and the fix, not a traceback."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        run_dir = disk / "full"
        proc = _start_job(
            disk, "full", tiny_mock_job, "--set", "trainer.num_train_steps=1000",
            "--set", "trainer.checkpoint_interval_steps=2",
        )  # fmt: skip
        _wait_for(proc, "a checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists())
        with (disk / "filler").open("wb") as filler:  # take every byte that is left
            try:
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
            except OSError:
                pass
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == ExitCode.RUN_DIR, stderr[-3000:]
        assert "No space left on device" in stderr and "free some space" in stderr
        assert "Traceback" not in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(disk)])


NAN_LOSS = """
import equinox as eqx

from marin_rl_core import LossPlugin, hookimpl
from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss


class NanLoss(RLOOLoss):
    def create_loss_fn(self, reference_model, train_model):
        inner = super().create_loss_fn(reference_model, train_model)

        def loss_fn(model, batch, *, key=None):
            out = inner(model, batch, key=key)
            return eqx.tree_at(lambda t: t.loss, out, out.loss * float("nan"))  # its own bug

        return loss_fn


@hookimpl
def marinrl_register_losses():
    yield LossPlugin(name="nan_loss", summary="a NaN loss", config_class=RLOOConfig,
                     build=NanLoss)
"""


def test_a_loss_that_is_nan_names_its_plugin_and_not_the_learning_rate(tmp_path, tiny_mock_job):
    """A loss plugin whose loss is NaN from the first step, with finite parameters: the stop
    names the plugin and the loss's own computation (not "lower trainer.learning_rate", which
    was wrong advice), and the step's row is in metrics.jsonl."""
    (tmp_path / "nanloss.py").write_text(NAN_LOSS)
    result = _run_with_plugin(
        tmp_path, "nanloss", *tiny_mock_job, "--loss", "nan_loss",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "nan", timeout=300,
    )  # fmt: skip
    out = " ".join(result.stderr.split())
    assert result.returncode == ExitCode.FAILURE, result.stderr[-3000:]
    assert "training diverged at step 1" in out and "'nan_loss' loss plugin's loss is nan" in out
    assert "the learning rate is not the cause" in out and "lower trainer.learning_rate" not in out
    rows = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").open()]
    (row,) = [r for r in rows if r["source"] == "train"]
    assert (
        row["step"] == 1 and row["diverged"] == 1.0 and row["loss"] == "nan"
    )  # (as JSON holds it)
