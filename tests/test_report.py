"""The reward plot's smoothing: the train curve users follow is a running mean of batch rewards."""

from __future__ import annotations

import pytest

from marin_rl_core.cli.report import _running_mean


def test_running_mean_averages_the_last_window_values():
    assert _running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]


def test_running_mean_uses_what_there_is_at_the_start():
    values = [0.0, 1.0, 0.0, 1.0]
    assert _running_mean(values, 10) == pytest.approx([0.0, 0.5, 1 / 3, 0.5])


def test_the_summary_says_where_the_time_went_and_which_side_holds_the_job_back(tmp_path):
    import json

    from rich.console import Console

    from marin_rl_core.cli.report import render_summary, summarize

    rows = [
        {"source": "train", "step": s, "time": float(s), "reward": 0.5, "wait_seconds": 0.3,
         "step_seconds": 0.1, "publish_seconds": 0.0, "checkpoint_seconds": 0.0}
        for s in (1, 2)
    ] + [
        {"source": "rollout", "step": 1, "time": 1.0, "rollout/seconds": 0.2,
         "rollout/score_seconds": 0.05, "rollout/weight_sync_seconds": 0.0,
         "rollout/write_seconds": 0.0}
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(tmp_path)
    assert summary["stages"]["trainer"]["waiting for rollouts"] == pytest.approx(0.3)
    assert summary["stages"]["rollout"]["generating"] == pytest.approx(0.2)
    console = Console(width=200, record=True)
    console.print(render_summary(summary))
    text = console.export_text()
    assert "trainer per step: waiting for rollouts 0.300 s (75%), training 0.100 s (25%)" in text
    assert "rollout worker per batch: generating 0.200 s (80%), scoring 0.050 s (20%)" in text
    assert "bottleneck: the rollout side: the trainer waits for rollouts 75% of the time" in text
    # Paced workers that mostly wait for weights are not the bottleneck the trainer waits on.
    rows[-1]["rollout/paced_seconds"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    console = Console(width=300, record=True)
    console.print(render_summary(summarize(tmp_path)))
    text = console.export_text()
    assert "paced (waiting for newer weights) 0.500 s (67%)" in text
    assert "bottleneck: the hand-off: the trainer waits for rollouts 75% of the time" in text


def test_the_summary_shows_episodes_of_multi_turn_lessons_and_env_failures(tmp_path):
    import json

    from rich.console import Console

    from marin_rl_core.cli.report import render_summary, summarize

    def rollout_row(lesson, reward, turns, step_s, timeouts=0, errors=0):
        return {
            "source": "rollout", "step": 1, "time": 1.0, "rollout/lesson": lesson,
            "rollout/reward": reward, "rollout/turns": turns, "rollout/env_step_seconds": step_s,
            "rollout/env_timeouts": timeouts, "rollout/env_errors": errors,
        }  # fmt: skip

    rows = [
        rollout_row("guess", 0.5, 3.0, 0.01),
        rollout_row("guess", 0.7, 2.0, 0.03, timeouts=2),
        rollout_row("add", 0.9, 1.0, 0.001),  # single-turn, nothing failed: no line
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    episodes = summarize(tmp_path)["episodes"]
    assert episodes["guess"] == pytest.approx(
        {"success": 0.6, "turns": 2.5, "env_step_seconds": 0.02, "env_timeouts": 2, "env_errors": 0}
    )
    console = Console(width=200, record=True)
    console.print(render_summary(summarize(tmp_path)))
    text = console.export_text()
    assert (
        "episodes of guess: train success 0.600, 2.50 turns, env step 0.0200 s, 2 env timeouts, "
        "0 env errors" in text
    )
    assert "episodes of add" not in text


def test_report_skips_and_counts_lines_that_are_json_but_not_rows(cli, tmp_path):
    """Valid JSON that is not a metrics row (``null``, a list, a number, an object without a
    step) is skipped and counted like a line of damaged bytes, not a crash."""
    import json

    rows = [{"source": "train", "step": s, "time": float(s), "reward": 0.25 * s} for s in (1, 2)]
    lines = [json.dumps(rows[0]), "null", "[1, 2]", "7", '{"reward": 1.0}', "{not json",
             json.dumps(rows[1])]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("report", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "2 train steps" in result.output
    assert "skipped 5 damaged lines of metrics.jsonl" in result.output
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_a_resumed_runs_seconds_leave_out_the_time_between_the_runs(tmp_path, monkeypatch):
    """A run stopped at step 3 and resumed from step 2 an hour later: its summary counts the
    two runs' own seconds, not the hour between them (issue 51)."""
    import types

    import marin_rl_core.metrics as metrics
    from marin_rl_core.cli.report import summarize
    from marin_rl_core.metrics import MetricsHub

    now = [1000.0]
    # The hub's clock only (not time.time for the whole process).
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(time=lambda: now[0]))
    hub = MetricsHub(str(tmp_path))
    for step in (1, 2, 3):
        now[0] += 10 / 3
        hub.log({"reward": 0.1}, step=step, source="train")
    now[0] += 3600.0
    hub.resume_at(2)  # the resumed run starts here
    for step in (3, 4):
        now[0] += 2.5
        hub.log({"reward": 0.2}, step=step, source="train")
    hub.close()
    summary = summarize(tmp_path)
    assert summary["train_steps"] == 4
    # The first run from its first row (step 1) to its last kept one (step 2: step 3 is
    # trained again); the second from its start, 5 s. Not the hour between.
    assert summary["seconds"] == pytest.approx(10 / 3 + 5)
