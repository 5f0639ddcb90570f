"""What a user looks at after a run: a summary table and the reward curve (PNG).

``marinrl report RUN_DIR`` redraws both from ``RUN_DIR/metrics.jsonl`` at any time, also while a
run is going or after it was interrupted.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from marin_rl_core.metrics import read_metrics

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
    """Draw train reward and each lesson's eval reward against trainer step into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / PLOT_FILE
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
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
    ax.set_title(f"{Path(run_dir).name}: reward")
    # Outside the axes: inside, it always covers some curve.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The numbers the summary table shows, as data."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("source") == "train"]
    summary: dict[str, Any] = {"run_dir": str(run_dir), "train_steps": 0}
    if train:
        last = train[-1]
        summary.update(
            train_steps=int(last["step"]),
            seconds=float(last["time"] - rows[0]["time"]),
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
    return summary


def render_summary(summary: dict[str, Any]) -> Any:
    """A rich table of :func:`summarize`'s output."""
    from rich.table import Table

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
    return table
