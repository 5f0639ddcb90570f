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

import attrs
from episode_bench import add_episode_args, episode_managers, timed_batch

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
    add_episode_args(parser, problems=8, samples=8, batches=6)
    args = parser.parse_args()

    registry = build_registry(modules=[wait_plugin])
    managers = episode_managers(
        registry, args, {d: ("wait", [f"env.delay_s={d}"]) for d in (0.0, args.delay)}
    )

    def one(delay: float, seed: int) -> tuple[float, float, float]:
        wall, _, metrics = timed_batch(managers[delay], "wait", args, seed)
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
