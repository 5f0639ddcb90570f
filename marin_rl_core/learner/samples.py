"""What users read of the rollouts the trainer trained on: ``samples.jsonl`` in the run directory,
a few rollouts of each step (``logging.samples_per_step``) decoded, turn by turn; the rollout
workers' evals keep as many of each lesson's held-out rollouts the same way
(``eval_samples.jsonl``, through the :class:`~marin_rl_core.metrics.MetricsHub`). And the
figures of a step's rollouts in its ``train`` row (:func:`rollout_metrics`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marin_rl_core.sample_rows import sample_row
from marin_rl_core.types import Rollout


def write_samples(path: Path, rollouts: Sequence[Rollout], *, step: int, tokenizer: Any) -> None:
    """Append ``rollouts`` (trained on at ``step``), decoded, to the JSON lines file ``path``."""
    if not rollouts:
        return
    with path.open("a") as f:
        for r in rollouts:
            f.write(json.dumps(sample_row(r, tokenizer, step=step)) + "\n")


def zero_variance_fraction(rollouts: list[Rollout]) -> float:
    """Fraction of groups (samples of one problem from one batch) whose rewards are all equal:
    they carry no RLOO gradient. A rising value warns of a policy going deterministic."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rollouts:
        meta = r.metadata
        key = (
            r.lesson_id,
            r.problem_id,
            meta.worker_id if meta else "",
            meta.timestamp if meta else 0,
        )
        groups.setdefault(key, []).append(r.reward)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return 0.0
    return float(np.mean([max(g) == min(g) for g in sized]))


def rollout_metrics(rollouts: list[Rollout], *, trained_at: int) -> dict[str, float]:
    """What a step's rollouts say in its ``train`` row: their mean reward, the
    :func:`zero_variance_fraction` of their groups, and how many steps behind ``trained_at``
    (the weights' step trained on) the weights that sampled them were, on average."""
    lags = [trained_at - r.metadata.weight_step for r in rollouts if r.metadata]
    return {
        "reward": float(np.mean([r.reward for r in rollouts])),
        "frac_zero_variance_groups": zero_variance_fraction(rollouts),
        "mean_weight_lag": float(np.mean(lags)) if lags else float("nan"),
    }
