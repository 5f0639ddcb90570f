"""``describe``: an env whose answers no program can grade. The policy is asked to describe a few
animals in a few words; a judge model grades each description against a rubric
(``describe.toml``'s ``[[reward.terms]]``), and the env reports only what a program can count
beside it: the description's words, letters and characters.

The env's own reward is 0 for every response: a run of this env takes its reward from reward
terms (a ``judge``, a ``length`` penalty), never from the env.
"""

from __future__ import annotations

import random

import attrs

from marin_rl_core import EnvPlugin, LessonConfig, Problem, Score, hookimpl

ANIMALS = ("cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig", "hen", "yak")


@attrs.frozen(kw_only=True)
class DescribeConfig:
    """Args:
    animals: how many animals each prompt names.
    """

    animals: int = attrs.field(default=2, validator=attrs.validators.in_(range(1, 6)))


class DescribeEnv:
    """Implements marin_rl_core.Env: ``describe: cat owl =`` is answered by a few words."""

    def __init__(self, config: DescribeConfig):
        self.config = config

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        rng = random.Random(f"{mode}-{seed}")  # held-out problems: another stream
        problems = []
        for i in range(n):
            names = " ".join(rng.sample(ANIMALS, self.config.animals))
            problems.append(Problem(id=f"{mode}-{seed}-{i}", prompt=f"describe: {names} ="))
        return problems

    def score(self, problem: Problem, response: str) -> Score:
        words = response.split()
        letters = sum(c.isalpha() for c in response)
        return Score(
            0.0, {"words": len(words), "letters": letters, "characters": len(response.strip())}
        )


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="describe",
        summary="Describe animals in a few words: graded by a judge model (an example).",
        config_class=DescribeConfig,
        build=DescribeEnv,
        default_lessons=lambda config: [LessonConfig(id="describe", env="describe")],
    )
