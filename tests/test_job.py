"""The whole Ray job, for a few steps on the mock env: rollouts flow, weights sync, every rollout
carries its metadata, paced workers make nothing stale, and a second run resumes from the checkpoint.
(tests/test_ray_cluster.py runs the job on a separately started cluster.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.job.driver import RLJob
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


def small_job(env: str, run_dir: Path, run_id: str, *overrides: str) -> RLJob:
    """A job of the SMALL settings (and ``overrides``) on ``env``."""
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": env},
        overrides=[*SMALL, f'run_dir="{run_dir}"', f'run_id="{run_id}"', *overrides],
    )
    return RLJob(config, registry)


@pytest.fixture(scope="module")
def ray_session(start_local_ray):
    local = start_local_ray(2)
    yield
    local.stop()


@pytest.fixture(scope="module")
def first_run(ray_session, tmp_path_factory):
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
        ],
    )
    result = RLJob(config, registry).run(progress=False)
    return result, registry, run_dir


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


def test_paced_workers_generate_what_is_trained_and_nothing_stale(first_run):
    """Pacing (replay_buffer.max_generated_per_trained = 1): with on-policy training the worker
    makes one batch per weight version and waits for the next, so no rollout arrives stale
    and at most the batch in flight when training ended goes unused."""
    result, _, _ = first_run
    rows = read_metrics(result.run_dir)
    train = [r for r in rows if r["source"] == "train"]
    assert sum(r.get("replay/dropped_stale_step", 0) for r in train) == 0
    generated = sum(r.get("rollout/rollouts", 0) for r in rows if r["source"] == "rollout")
    trained = sum(r["replay/sampled_rollouts"] for r in train)
    assert trained == 4 * 32
    assert trained <= generated <= trained + 32
    assert any(r.get("rollout/paced_seconds", 0) > 0 for r in rows if r["source"] == "rollout")


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


def test_a_second_run_resumes_from_the_checkpoint(first_run):
    result, registry, run_dir = first_run
    config = resolve_config(
        registry,
        files=[result.run_dir / "config.toml"],
        overrides=["trainer.num_train_steps=6"],
    )
    again = RLJob(config, registry).run(progress=False)
    assert again.run_dir == result.run_dir
    train = [r for r in read_metrics(again.run_dir) if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # 5 and 6 come from the resumed run
    assert again.final_step == 6
    assert (Path(again.run_dir) / "checkpoints" / "step-000006" / "state.json").exists()


def test_report_draws_the_reward_curve(first_run, cli):
    result, _, _ = first_run
    out = cli("report", str(result.run_dir))
    assert out.exit_code == 0, out.output
    png = result.run_dir / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mock" in out.output


def test_a_multi_turn_job_trains_on_packed_rows_and_logs_its_turns(ray_session, tmp_path):
    """The guess game through the whole job, with several rollouts per training row."""
    result = small_job(
        "guess",
        tmp_path,
        "game",
        "trainer.num_train_steps=3",
        "trainer.pack_rollouts=true",
        "replay_buffer.max_rollout_step_delay=1",
        # The guess lesson samples 32 prompts a batch of its own; a batch of 32 rows needs 4.
        "curriculum.lessons[0].sampling.n_prompts=4",
    ).run(progress=False)
    assert result.final_step == 3
    rows = read_metrics(tmp_path / "game")
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in train)  # finite, not NaN
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/turns" in r]
    assert batches and all(r["rollout/turns"] > 1 for r in batches)  # few first guesses win
    samples = [json.loads(line) for line in (tmp_path / "game" / "samples.jsonl").open()]
    turns = [t for s in samples for t in s["turns"]]
    assert {t["observation"] for t in turns} <= {"<", ">", "?", ""}
    assert any(t["observation"] in "<>?" and t["observation"] for t in turns)


def test_packed_rows_never_outnumber_the_batch(ray_session, tmp_path):
    """60 rollouts that cannot share a row (prompts of 5 tokens, rows of 11) make 60 rows.
    Packed row counts are rounded up to an eighth of the batch (7), which would make 63 rows,
    more than the batch of 60 that levanter splits into micro-batches: every such step crashed."""
    result = small_job(
        "math",
        tmp_path,
        "packed",
        "trainer.num_train_steps=2",
        "trainer.batch_size=60",
        "sampling.n_prompts=10",
        "sampling.n_generations_per_prompt=6",
        "model.max_seq_len=11",
        'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        "trainer.pack_rollouts=true",
        "eval.frequency=100",
    ).run(progress=False)
    assert result.final_step == 2
    train = [r for r in read_metrics(tmp_path / "packed") if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2]


def test_a_trainer_short_of_rollouts_gets_more_from_a_paced_worker(ray_session, tmp_path):
    """Pacing for half a batch per step, one batch of 32 per weight version, a trainer that
    needs 64: the worker is ahead after each batch, and only the trainer's word that it is
    short of rollouts (asked through its actor) lets it go on before newer weights come."""
    result = small_job(
        "mock",
        tmp_path,
        "starved",
        "trainer.batch_size=64",
        "trainer.num_train_steps=2",
        "replay_buffer.max_generated_per_trained=0.5",
    ).run(progress=False)
    assert result.final_step == 2
    log = (tmp_path / "starved" / "logs" / "rollout-0.log").read_text()
    assert "the trainer is short of rollouts while paced" in log
    assert "no newer weights for" not in log
