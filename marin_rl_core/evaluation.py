"""Offline evaluation of a saved checkpoint: a :class:`RolloutManager` on its own.

No Ray, no weight transfer, no storage: load the run's config and the checkpoint's weights, and
score held-out problems of every lesson with the run's eval sampling params.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marin_rl_core.checkpoint import resolve_checkpoint
from marin_rl_core.config import resolve_config
from marin_rl_core.registry import Registry
from marin_rl_core.rollout_worker import EVAL_SEED_OFFSET


def evaluate_checkpoint(
    path: str | Path, registry: Registry, *, n_examples: int | None = None
) -> dict[str, Any]:
    """Score ``path`` (a run directory or one of its checkpoints) on every lesson.

    Returns ``{"checkpoint": str, "step": int, "lessons": {id: {"reward": float, "n": int,
    ...}}}``; a lesson whose env returns :class:`~marin_rl_core.types.Score` s also has each
    score metric's mean (``"format"``, ``"correct"`` ...).
    """
    import json

    from marin_rl_core.checkpoint import load_model
    from marin_rl_core.rollout_manager import RolloutManager
    from marin_rl_core.tokenizer import model_tokenizer
    from marin_rl_core.trainer import initial_model

    checkpoint = resolve_checkpoint(path)
    run_dir = checkpoint.parent.parent
    config_file = run_dir / "config.toml"
    if not config_file.exists():
        raise FileNotFoundError(
            f"{config_file} does not exist: the checkpoint's run config is needed"
        )
    config = resolve_config(registry, files=[config_file])
    step = int(json.loads((checkpoint / "state.json").read_text())["step"])
    tokenizer = model_tokenizer(config.model)
    model = load_model(checkpoint, initial_model(config, tokenizer))
    manager = RolloutManager(config, registry, model=model, tokenizer=tokenizer)
    results = manager.evaluate_curriculum(
        n_examples=n_examples or config.eval.n_examples,
        seed=config.seed + EVAL_SEED_OFFSET,
        step=step,
        weight_step=step,
        worker_id="eval",
    )
    manager.shutdown()
    return {
        "checkpoint": str(checkpoint),
        "step": step,
        "lessons": {
            lesson: {"reward": stats.mean_reward, "n": stats.n_rollouts, **stats.metrics}
            for lesson, (stats, _) in results.items()
        },
    }
