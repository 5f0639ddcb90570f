"""What the episode benches share (``episode_concurrency.py``, ``agent_endpoint.py``): their
command-line arguments, one rollout manager per variant of a multi-turn set-up on the default
tiny model, and a timed batch."""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_episode_args(
    parser: argparse.ArgumentParser, *, problems: int, samples: int, batches: int
) -> None:
    """``--turns``, ``--action-tokens``, ``--batches``, ``--problems``, ``--samples``, ``--set``."""
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--action-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, default=batches)
    parser.add_argument("--problems", type=int, default=problems)
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--set", dest="overrides", action="append", default=[])


def episode_managers(
    registry: Any, args: argparse.Namespace, variants: dict[Any, tuple[str, list[str]]]
) -> dict[Any, Any]:
    """A :class:`~marin_rl_core.rollout.manager.RolloutManager` per variant (``key: (env, its
    own overrides)``), each sampling ``args.problems x args.samples`` episodes of
    ``args.turns`` actions of up to ``args.action_tokens`` tokens."""
    from marin_rl_core.config import resolve_config
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    seq = 8 + args.turns * (args.action_tokens + 2)
    managers = {}
    for key, (env, overrides) in variants.items():
        config = resolve_config(
            registry,
            selections={"env": env},
            overrides=[
                f"env.turns={args.turns}",
                *overrides,
                f"model.max_seq_len={seq}",
                f"episodes.max_turns={args.turns}",
                f"sampling.max_tokens={args.action_tokens}",
                f"eval.sampling.max_tokens={args.action_tokens}",
                f"sampling.n_prompts={args.problems}",
                f"sampling.n_generations_per_prompt={args.samples}",
                f"trainer.batch_size={args.problems * args.samples}",
                *args.overrides,
            ],
        )
        tokenizer = model_tokenizer(config.model)
        managers[key] = RolloutManager(
            config, registry, model=initial_model(config, tokenizer), tokenizer=tokenizer
        )
    return managers


def timed_batch(
    manager: Any, env: str, args: argparse.Namespace, seed: int
) -> tuple[float, Any, dict[str, float]]:
    """One training batch of ``env``: its wall seconds, the batch and its metrics."""
    start = time.perf_counter()
    batch, metrics = manager.sample_batch(
        env, n_examples=args.problems, n_generations=args.samples, mode="train",
        seed=seed, weight_step=0, worker_id="bench",
    )  # fmt: skip
    return time.perf_counter() - start, batch, metrics
