"""What a user looks at after a run: a summary table and the reward curve (PNG).

``marinrl report RUN_DIR`` redraws both from ``RUN_DIR/metrics.jsonl`` at any time, also while a
run is going or after it was interrupted.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from marin_rl_core.metrics import read_metrics, read_metrics_counted
from marin_rl_core.rundir import is_remote, local_copy, put, run_path

PLOT_FILE = "reward_curve.png"
SMOOTHING_STEPS = 50


def _series(rows: list[dict[str, Any]], source: str, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if row.get("source") == source and isinstance(value, int | float):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def _running_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def eval_lessons(rows: list[dict[str, Any]]) -> list[str]:
    """Lessons that have eval rows, in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        if row.get("source") == "eval":
            for key in row:
                if key.startswith("eval/") and key.endswith("/reward"):
                    seen[key[len("eval/") : -len("/reward")]] = None
    return list(seen)


def plot_reward_curve(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw train reward and each lesson's eval reward against trainer step into a PNG
    (``RUN_DIR/reward_curve.png`` by default; for a run on a bucket, drawn in its local copy and
    uploaded). Returns where it is."""
    # matplotlib's object API, not pyplot: no global figure state (this runs in the driver and
    # in tests' processes beside other threads), and 0.2 CPU-s less to import; same PNG.
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    out = Path(out) if out else local_copy(run_dir) / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.subplots()
    steps, values = _series(rows, "train", "reward")
    if steps:
        # Batches of different lessons have very different rewards: the raw line is faint, the
        # running mean is what the eye should follow.
        ax.plot(steps, values, color="0.75", linewidth=0.6, label="train reward (batch mean)")
        window = min(SMOOTHING_STEPS, len(values))
        ax.plot(
            steps,
            _running_mean(values, window),
            color="0.25",
            linewidth=1.5,
            label=f"train reward ({window}-step mean)",
        )
    for lesson in eval_lessons(rows):
        s, v = _series(rows, "eval", f"eval/{lesson}/reward")
        ax.plot(s, v, marker="o", markersize=3, linewidth=1.5, label=f"eval: {lesson}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{run_path(run_dir).name}: reward")
    # Outside the axes: inside, it always covers some curve.
    if ax.get_legend_handles_labels()[0]:  # nothing logged yet: no legend to draw
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    if is_remote(run_dir) and out == local_copy(run_dir) / PLOT_FILE:
        return put(out, run_dir, PLOT_FILE)
    return out


def run_seconds(rows: list[dict[str, Any]]) -> float:
    """The wall seconds the run's processes ran: from each run's first row to its last, the
    runs split where a resumed run starts (its ``run`` row), so that the time between a run
    and its resumption is not counted."""
    total, first, last = 0.0, None, None
    for row in rows:
        at = row.get("time")
        if not isinstance(at, int | float):
            continue
        if row.get("source") == "run" and first is not None:
            total += last - first
            first = None
        first = at if first is None else first
        last = at
    return total + (last - first if first is not None else 0.0)


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The numbers the summary table shows, as data."""
    rows, damaged = read_metrics_counted(run_dir)
    train = [r for r in rows if r.get("source") == "train"]
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "train_steps": 0,
        "rows": len(rows),
        "damaged_rows": damaged,
    }
    if train:
        last = train[-1]
        summary.update(
            train_steps=int(last["step"]),
            seconds=run_seconds(rows),
            final_train_reward=last.get("reward"),
            final_entropy=last.get("entropy"),
        )
    lessons: dict[str, dict[str, float]] = defaultdict(dict)
    for lesson in eval_lessons(rows):
        steps, values = _series(rows, "eval", f"eval/{lesson}/reward")
        if values:
            lessons[lesson] = {
                "first": values[0],
                "last": values[-1],
                "best": max(values),
                "first_step": steps[0],
                "last_step": steps[-1],
            }
    summary["eval"] = dict(lessons)
    summary["stages"] = stage_seconds(rows)
    summary["episodes"] = episode_stats(rows)
    return summary


def episode_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per lesson, over its training batches: ``success`` (mean episode reward), ``turns`` (mean
    actions per episode), ``env_step_seconds`` (mean per env step), ``env_timeouts`` and
    ``env_errors`` (totals)."""
    by_lesson: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("source") == "rollout" and isinstance(row.get("rollout/lesson"), str):
            by_lesson[row["rollout/lesson"]].append(row)
    out: dict[str, dict[str, float]] = {}

    def values(lesson_rows: list[dict[str, Any]], key: str) -> list[float]:
        return [float(r[key]) for r in lesson_rows if isinstance(r.get(key), int | float)]

    for lesson, lesson_rows in sorted(by_lesson.items()):
        stats = {}
        for name, key in (
            ("success", "rollout/reward"),
            ("turns", "rollout/turns"),
            ("env_step_seconds", "rollout/env_step_seconds"),
        ):
            found = values(lesson_rows, key)
            if found:
                stats[name] = sum(found) / len(found)
        for name in ("env_timeouts", "env_errors"):
            stats[name] = sum(values(lesson_rows, f"rollout/{name}"))
        out[lesson] = stats
    return out


TRAINER_STAGES = {
    "waiting for rollouts": "wait_seconds",
    "training": "step_seconds",
    "publishing weights": "publish_seconds",
    "checkpointing": "checkpoint_seconds",
}
ROLLOUT_STAGES = {
    "generating": "rollout/seconds",
    "scoring": "rollout/score_seconds",
    "pulling weights": "rollout/weight_sync_seconds",
    "blocked writing (storage full)": "rollout/write_seconds",
    "paced (waiting for newer weights)": "rollout/paced_seconds",
}


def stage_seconds(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean seconds per trainer step and per rollout batch in each stage (seed 004's pipeline
    monitor): ``{"trainer": {stage: s}, "rollout": {stage: s}}``, stages with data only."""
    out: dict[str, dict[str, float]] = {}
    for side, source, stages in (
        ("trainer", "train", TRAINER_STAGES),
        ("rollout", "rollout", ROLLOUT_STAGES),
    ):
        side_rows = [r for r in rows if r.get("source") == source]
        means = {}
        for stage, key in stages.items():
            values = [float(r[key]) for r in side_rows if isinstance(r.get(key), int | float)]
            if values:
                means[stage] = sum(values) / len(values)
        if means:
            out[side] = means
    return out


def bottleneck(stages: dict[str, dict[str, float]]) -> str | None:
    """Which side holds the job back, from :func:`stage_seconds`."""
    trainer = stages.get("trainer", {})
    rollout = stages.get("rollout", {})
    if trainer and sum(trainer.values()) > 0:
        waiting = trainer.get("waiting for rollouts", 0.0) / sum(trainer.values())
        paced = 0.0
        if rollout and sum(rollout.values()) > 0:
            paced = rollout.get("paced (waiting for newer weights)", 0.0) / sum(rollout.values())
        if waiting > 0.5 and paced > 0.3:
            return (
                f"the hand-off: the trainer waits for rollouts {waiting:.0%} of the time (reading "
                f"them in included) while paced rollout workers wait for newer weights "
                f"{paced:.0%} of theirs; on a machine the two share, they take turns"
            )
        if waiting > 0.5:
            return f"the rollout side: the trainer waits for rollouts {waiting:.0%} of the time"
    if rollout and sum(rollout.values()) > 0:
        blocked = rollout.get("blocked writing (storage full)", 0.0) / sum(rollout.values())
        if blocked > 0.3:
            return f"the trainer: rollout workers wait on full storage {blocked:.0%} of the time"
    return None


def _stage_line(name: str, unit: str, stages: dict[str, float]) -> str:
    total = sum(stages.values()) or 1.0
    parts = ", ".join(f"{stage} {s:.3f} s ({s / total:.0%})" for stage, s in stages.items())
    return f"{name} per {unit}: {parts}"


def render_summary(summary: dict[str, Any]) -> Any:
    """A rich table of :func:`summarize`'s output, with the per-stage timings below it."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"run {summary['run_dir']}", show_lines=False)
    table.add_column("lesson")
    table.add_column("eval reward at start", justify="right")
    table.add_column("at end", justify="right")
    table.add_column("best", justify="right")
    for lesson, s in summary["eval"].items():
        table.add_row(
            lesson,
            f"{s['first']:.3f} (step {s['first_step']})",
            f"{s['last']:.3f} (step {s['last_step']})",
            f"{s['best']:.3f}",
        )
    caption = [f"{summary['train_steps']} train steps"]
    if summary.get("seconds") is not None:
        caption.append(f"{summary['seconds']:.0f} s")
    if isinstance(summary.get("final_train_reward"), float):
        caption.append(f"final train reward {summary['final_train_reward']:.3f}")
    if isinstance(summary.get("final_entropy"), float):
        caption.append(f"entropy {summary['final_entropy']:.3f}")
    table.caption = ", ".join(caption)
    # Where the time went: below the table, one line each (a caption would wrap them).
    lines = []
    stages = summary.get("stages", {})
    if "trainer" in stages:
        lines.append(_stage_line("trainer", "step", stages["trainer"]))
    if "rollout" in stages:
        lines.append(_stage_line("rollout worker", "batch", stages["rollout"]))
    slowest = bottleneck(stages)
    if slowest:
        lines.append(f"bottleneck: {slowest}")
    for lesson, e in summary.get("episodes", {}).items():
        # Shown for multi-turn lessons, and for any lesson whose env timed out or failed.
        if e.get("turns", 1.0) > 1.0 or e.get("env_timeouts") or e.get("env_errors"):
            lines.append(
                f"episodes of {lesson}: train success {e.get('success', 0.0):.3f}, "
                f"{e.get('turns', 1.0):.2f} turns, env step {e.get('env_step_seconds', 0.0):.4f} s, "
                f"{e['env_timeouts']:.0f} env timeouts, {e['env_errors']:.0f} env errors"
            )
    if summary.get("damaged_rows"):
        lines.append(
            f"skipped {summary['damaged_rows']} damaged lines of metrics.jsonl (not JSON objects "
            "with a step and a source)"
        )
    return Group(table, *(Text(line) for line in lines))
