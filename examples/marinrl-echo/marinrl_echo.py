"""``echo``: a minimal third-party marinrl env. The policy must repeat a list of numbers.

The whole plugin is this module plus one entry point in ``pyproject.toml``. It imports only
marinrl's public surface, and nothing heavy, so ``marinrl plugins list`` stays fast.
"""

from __future__ import annotations

import random

import attrs

from marin_rl_core import EnvPlugin, LessonConfig, Problem, hookimpl


@attrs.frozen(kw_only=True)
class EchoConfig:
    """Args:
    length: how many numbers each prompt holds.
    max_value: numbers are drawn from 0..max_value.
    """

    length: int = 2
    max_value: int = 9


class EchoEnv:
    """Implements marin_rl_core.Env: ``echo: 3 7`` is answered by ``3 7``."""

    def __init__(self, config: EchoConfig):
        self.config = config

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        # Held-out eval problems come from a different stream than training ones.
        rng = random.Random(f"{mode}-{seed}")
        problems = []
        for i in range(n):
            numbers = [rng.randint(0, self.config.max_value) for _ in range(self.config.length)]
            text = " ".join(str(x) for x in numbers)
            problems.append(Problem(id=f"{mode}-{seed}-{i}", prompt=f"echo: {text} =", answer=text))
        return problems

    def score(self, problem: Problem, response: str) -> float:
        return float(response.split() == problem.answer.split())


def default_lessons(config: EchoConfig) -> list[LessonConfig]:
    return [LessonConfig(id="echo", env="echo", stop_threshold=0.9)]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="echo",
        summary="Repeat a list of numbers (an example third-party plugin).",
        config_class=EchoConfig,
        build=EchoEnv,
        default_lessons=default_lessons,
    )
