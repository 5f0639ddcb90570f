"""What users read of the rollouts the trainer trained on: ``samples.jsonl`` in the run directory,
a few rollouts of each step (``logging.samples_per_step``) decoded, turn by turn."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marin_rl_core.types import Rollout


def sample_turns(rollout: Rollout, tokenizer: Any) -> list[dict[str, Any]]:
    """Each turn of ``rollout`` decoded, as ``samples.jsonl`` shows it: the policy's
    ``action``, the env's ``observation`` after it (empty after the last turn) and the turn's
    ``reward``."""
    turns = []
    for (start, end), reward in zip(rollout.turn_spans(), rollout.turn_rewards.tolist()):
        mask = rollout.loss_mask[start:end]
        # An action is the run of sampled tokens the turn starts with; the rest is observation.
        unsampled = np.flatnonzero(~mask)
        split = start + (int(unsampled[0]) if unsampled.size else end - start)
        turns.append(
            {
                "action": tokenizer.decode(rollout.tokens[start:split].tolist()),
                "observation": tokenizer.decode(rollout.tokens[split:end].tolist()),
                "reward": reward,
            }
        )
    return turns


def write_samples(path: Path, rollouts: Sequence[Rollout], *, step: int, tokenizer: Any) -> None:
    """Append ``rollouts`` (trained on at ``step``), decoded, to the JSON lines file ``path``."""
    if not rollouts:
        return
    with path.open("a") as f:
        for r in rollouts:
            meta = r.metadata
            row = {
                "step": step,
                "lesson": r.lesson_id,
                "problem": r.problem_id,
                "prompt": tokenizer.decode(r.prompt_tokens.tolist()),
                "response": tokenizer.decode(r.response_tokens.tolist()),
                "turns": sample_turns(r, tokenizer),
                "part": r.part,
                "reward": r.reward,
                **({"reward_terms": dict(r.reward_terms)} if r.reward_terms else {}),
                "truncated": r.truncated,
                "worker_id": meta.worker_id if meta else None,
                "worker": meta.worker_index if meta else None,
                "batch": meta.batch_index if meta else None,
                "weight_step": meta.weight_step if meta else None,
                "timestamp": meta.timestamp if meta else None,
            }
            f.write(json.dumps(row) + "\n")


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
