"""Offline evaluation of a saved checkpoint: a :class:`RolloutManager` on its own.

No Ray, no weight transfer, no storage: load the run's config and the checkpoint's weights, and
score held-out problems of every lesson with the run's eval sampling params.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marin_rl_core.config.loading import resolve_config
from marin_rl_core.learner.checkpoint import STATE_FILE, resolve_checkpoint, run_config_file
from marin_rl_core.registry import Registry
from marin_rl_core.rollout.worker import EVAL_SEED_OFFSET
from marin_rl_core.rundir import run_path


def evaluate_checkpoint(
    path: str | Path, registry: Registry, *, n_examples: int | None = None
) -> dict[str, Any]:
    """Score ``path`` (a run directory or one of its checkpoints) on every lesson.

    A run directory's newest checkpoint that can be read is used (damaged newer ones are
    skipped and named in ``"warnings"``). Returns ``{"checkpoint": str, "step": int,
    "warnings": [str], "lessons": {id: {"reward": float, "n": int,
    ...}}}``; a lesson whose env returns :class:`~marin_rl_core.types.Score` s also has each
    score metric's mean (``"format"``, ``"correct"`` ...).
    """
    from marin_rl_core.learner.checkpoint import (
        CheckpointError,
        latest_checkpoint,
        load_newest,
        read_state,
    )
    from marin_rl_core.learner.lora_checkpoint import check_base, trained_policy
    from marin_rl_core.models.lora import trained_policy_like
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    path = run_path(path)
    if (path / "model.eqx").exists() or (path / STATE_FILE).exists():
        run_dir, candidates = path.parent.parent, [resolve_checkpoint(path)]
    else:
        run_dir, candidates = path, []
    config_file = run_config_file(run_dir)
    config = resolve_config(registry, files=[config_file])
    tokenizer = model_tokenizer(config.model)
    # A LoRA run's adapters belong on the base they name: a changed base is refused first
    # (not taken for a damaged checkpoint).
    newest = candidates[0] if candidates else latest_checkpoint(run_dir)
    if newest is not None:
        check_base(newest, config)
    like = trained_policy_like(config, tokenizer)

    def load(checkpoint: Path) -> tuple[int, Any]:
        # A LoRA run's policy is its base with the adapters merged in.
        step = int(read_state(checkpoint)["step"])
        return step, trained_policy(checkpoint, config, tokenizer, like=like)

    warnings: list[str] = []
    if candidates:  # one checkpoint asked for by name: no falling back
        checkpoint = candidates[0]
        try:
            step, model = load(checkpoint)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint} cannot be read ({type(exc).__name__}); it is damaged. "
                f"Give the run directory ({run_dir}) to use its newest intact checkpoint."
            ) from exc
    else:
        found = load_newest(run_dir, load, fallback="evaluated {name} instead")
        if found is None:
            resolve_checkpoint(run_dir)  # raises: no checkpoint
            raise AssertionError("unreachable")
        checkpoint, (step, model), warnings = found
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
        "warnings": warnings,
        "lessons": {
            lesson: {
                "reward": stats.mean_reward if stats.n_rollouts else None,
                "n": stats.n_rollouts,
                **stats.metrics,
            }
            for lesson, (stats, _) in results.items()
        },
    }
