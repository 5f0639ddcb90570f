"""The rows of a run's ``samples.jsonl`` (trained rollouts, written by the trainer) and
``eval_samples.jsonl`` (held-out rollouts of each eval, by the rollout workers through the
metrics hub): a rollout decoded, turn by turn, with its reward and where it came from."""

from __future__ import annotations

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


def sample_row(r: Rollout, tokenizer: Any, *, step: int) -> dict[str, Any]:
    """One rollout as ``samples.jsonl`` and ``eval_samples.jsonl`` show it: decoded, turn by
    turn, with its reward (and a combined reward's terms) and where it came from."""
    meta = r.metadata
    return {
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


__all__ = ["sample_row", "sample_turns"]
