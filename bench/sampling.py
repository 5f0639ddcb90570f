"""Rollout batches per second with each sampler, side by side in one run.

Builds the default job's rollout side (``RolloutManager``: envs, tokenizer, sampler) once with
each engine (levanter's paged ``InferenceEngine``, the dense sampler, the ``kv`` engine), and times
``sample_batch`` on one lesson: the whole batch (problems, prompts, generation, scoring,
rollouts) and the generation calls alone. Prints milliseconds per batch and the dense/paged
ratios to the paged engine (issue 11: its host work per sequence dominates short answers).

    python bench/sampling.py [--lesson add_1digit] [--batches 20] [--set KEY=VALUE ...]
    python bench/sampling.py --env guess --lesson guess_digit   # multi-turn episodes

Each engine is measured in a child process (bench/cells.py): a time limit (``timeout``'s SIGTERM)
or Ctrl-C stops it at once and prints the table of the engines measured so far.
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(kind: str, args: argparse.Namespace) -> dict[str, float]:
    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": args.env},
        overrides=[f'engine.name="{kind}"', *args.overrides],
    )
    tokenizer = model_tokenizer(config.model)
    manager = RolloutManager(
        config, registry, model=initial_model(config, tokenizer), tokenizer=tokenizer
    )
    sampling = config.sampling_for(manager.lessons[args.lesson])

    def one(seed: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        batch, metrics = manager.sample_batch(
            args.lesson,
            n_examples=sampling.n_prompts,
            n_generations=sampling.n_generations_per_prompt,
            mode="train",
            seed=seed,
            weight_step=0,
            worker_id="bench",
        )
        return time.perf_counter() - start, metrics["seconds"], len(batch.rollouts) if batch else 0

    for seed in range(3):  # compile every shape first
        one(10_000 + seed)
    runs = [one(seed) for seed in range(args.batches)]
    manager.shutdown()
    return {
        "batch_ms": 1000 * statistics.median(r[0] for r in runs),
        "generate_ms": 1000 * statistics.median(r[1] for r in runs),
        "rollouts": statistics.median(r[2] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="math")
    parser.add_argument("--lesson", default="add_1digit")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--engines", nargs="+", default=["paged", "dense", "kv"])
    args = parser.parse_args()
    import cells

    if cells.in_child():
        for kind in args.engines:
            cells.emit(kind=kind, **measure(kind, args))
        return
    records, _ = cells.run_in_child()
    results = {r.pop("kind"): r for r in records}
    print(f"{'sampler':>8} {'batch ms':>9} {'generate ms':>12} {'rollouts':>9}")
    for kind, r in results.items():
        print(f"{kind:>8} {r['batch_ms']:>9.1f} {r['generate_ms']:>12.1f} {r['rollouts']:>9.0f}")
    paged = results.get("paged")
    for kind, r in results.items():
        if paged is not None and kind != "paged":
            print(
                f"{kind} / paged: batch {r['batch_ms'] / paged['batch_ms']:.2f}x, "
                f"generation {r['generate_ms'] / paged['generate_ms']:.2f}x"
            )


if __name__ == "__main__":
    main()
