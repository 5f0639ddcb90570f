"""What users read of the rollouts the trainer trained on: ``samples.jsonl`` in the run directory,
a few rollouts of each step (``logging.samples_per_step``) decoded, turn by turn; the rollout
workers' evals keep as many of each lesson's held-out rollouts the same way
(``eval_samples.jsonl``, through the :class:`~marin_rl_core.metrics.MetricsHub`)."""

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
