"""Does generation stay busy while env steps wait? Rollout tokens/s with a slow env vs an
instant one, side by side.

Runs 64 concurrent multi-turn episodes (8 problems x 8 samples) of the default tiny model
through ``RolloutManager.sample_batch`` against an env whose ``async def step`` waits
``--delay`` seconds (a stand-in for a tool call) and against the same env answering at once,
alternating batch by batch, and prints the generated tokens per second of each and their ratio.
The bar (issue 10): the ratio is at least 0.8 with a 50 ms step.

    python bench/episode_concurrency.py [--delay 0.05] [--turns 4] [--action-tokens 16]
        [--batches 6] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import attrs

from marin_rl_core import EnvPlugin, Problem, Step, build_registry, hookimpl


@attrs.frozen
class WaitConfig:
    delay_s: float = 0.05
    turns: int = 4


class WaitEpisode:
    def __init__(self, config: WaitConfig):
        self.config, self.turn = config, 0

    async def step(self, action) -> Step:
        await asyncio.sleep(self.config.delay_s)
        self.turn += 1
        done = self.turn >= self.config.turns
        return Step(observation="!", reward=float(done), done=done)


class WaitEnv:
    def __init__(self, config: WaitConfig):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt=f"count: cat dog {i}") for i in range(n)]

    def reset(self, problem):
        return WaitEpisode(self.config)


class wait_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="wait", summary="steps wait delay_s", config_class=WaitConfig, build=WaitEnv
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--action-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    from marin_rl_core.config import resolve_config
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    registry = build_registry(modules=[wait_plugin])
    seq = 8 + args.turns * (args.action_tokens + 2)
    managers = {}
    for delay in (0.0, args.delay):
        config = resolve_config(
            registry,
            selections={"env": "wait"},
            overrides=[
                f"env.delay_s={delay}",
                f"env.turns={args.turns}",
                f"model.max_seq_len={seq}",
                f"sampling.max_tokens={args.action_tokens}",
                f"eval.sampling.max_tokens={args.action_tokens}",
                f"sampling.n_prompts={args.problems}",
                f"sampling.n_generations_per_prompt={args.samples}",
                f"trainer.batch_size={args.problems * args.samples}",
                *args.overrides,
            ],
        )
        tokenizer = model_tokenizer(config.model)
        managers[delay] = RolloutManager(
            config, registry, model=initial_model(config, tokenizer), tokenizer=tokenizer
        )

    def one(delay: float, seed: int) -> tuple[float, float, float]:
        start = time.perf_counter()
        batch, metrics = managers[delay].sample_batch(
            "wait", n_examples=args.problems, n_generations=args.samples, mode="train",
            seed=seed, weight_step=0, worker_id="bench",
        )  # fmt: skip
        wall = time.perf_counter() - start
        return metrics["generated_tokens"] / wall, metrics["seconds"] / wall, metrics["turns"]

    for delay in managers:  # compile
        one(delay, 0)
    rates: dict[float, list[float]] = {d: [] for d in managers}
    busy: dict[float, list[float]] = {d: [] for d in managers}
    for i in range(args.batches):
        for delay in managers:
            rate, gen_share, turns = one(delay, i + 1)
            rates[delay].append(rate)
            busy[delay].append(gen_share)
    episodes = args.problems * args.samples
    print(
        f"{episodes} concurrent episodes, {args.turns} turns of up to {args.action_tokens} tokens"
    )
    print(f"{'env step':>10} {'tokens/s (median)':>18} {'generating':>11}")
    for delay in managers:
        print(
            f"{delay * 1000:>8.0f}ms {statistics.median(rates[delay]):>18.0f} "
            f"{statistics.median(busy[delay]):>10.0%}"
        )
    ratio = statistics.median(rates[args.delay]) / statistics.median(rates[0.0])
    print(f"tokens/s with a {args.delay * 1000:.0f} ms step / instant: {ratio:.2f} (bar: >= 0.8)")


if __name__ == "__main__":
    main()
