"""The ``guess`` env: find a hidden digit in a few guesses, told "higher" or "lower" after each.

A multi-turn game the embedded tiny model learns from scratch with the arithmetic tokenizer. The
prompt carries no information (``?``); the hidden digit shows only through the feedback of later
turns, so the policy has to read the episode so far. One episode, as tokens::

    <bos> ?  5 <eos>  <  2 <eos>  >  3 <eos>        (hidden 3: "lower than 5", "higher than 2")

* an action is a guess: its text must start with one digit ``0..max_digit`` (``"3"``;
  anything after the digit is ignored; ``"37"`` or ``"x"`` is an invalid guess);
* the observation after a wrong guess is ``<`` (the hidden digit is lower), ``>`` (higher) or
  ``?`` (invalid guess); a right guess ends the episode with reward 1;
* after ``max_guesses`` wrong guesses the episode ends with reward 0.

With 10 digits and 4 guesses, a policy that ignores the feedback finds the digit at most 40% of
the time (four distinct guesses); binary search always finds it (``5``, then ``2`` or ``8``, ...).
Eval poses every hidden digit once; training draws them at random. The score metric ``guesses``
is the number of guesses an episode took.

This is also the worked example of docs/writing-plugins.md#multi-turn-envs.
"""

from __future__ import annotations

import re

import attrs
import numpy as np

from marin_rl_core import (
    Action,
    EnvPlugin,
    LessonConfig,
    Problem,
    SamplingParams,
    Step,
    hookimpl,
)

_GUESS = re.compile(r"(\d)(?!\d)")


@attrs.frozen(kw_only=True)
class GuessEnvConfig:
    """Args:
    max_digit: the hidden digit is drawn from ``0..max_digit`` (at most 9).
    max_guesses: guesses per episode.
    """

    max_digit: int = attrs.field(
        default=9, validator=[attrs.validators.ge(1), attrs.validators.le(9)]
    )
    max_guesses: int = attrs.field(default=4, validator=attrs.validators.ge(1))


class GuessEpisode:
    """One game: a hidden digit and the guesses so far."""

    def __init__(self, hidden: int, config: GuessEnvConfig):
        self.hidden = hidden
        self.config = config
        self.guesses = 0

    def step(self, action: Action) -> Step:
        self.guesses += 1
        match = _GUESS.match(action.text)
        guess = int(match.group(1)) if match else None
        metrics = {"guesses": float(self.guesses)}
        if guess == self.hidden:
            return Step(reward=1.0, done=True, metrics={**metrics, "found": 1.0})
        if self.guesses >= self.config.max_guesses:
            return Step(reward=0.0, done=True, metrics={**metrics, "found": 0.0})
        if guess is None or guess > self.config.max_digit:
            feedback = "?"
        else:
            feedback = "<" if self.hidden < guess else ">"
        return Step(observation=feedback, reward=0.0, done=False, metrics=metrics)


class GuessEnv:
    """Implements :class:`marin_rl_core.MultiTurnEnv`; see the module docstring."""

    def __init__(self, config: GuessEnvConfig):
        self.config = config

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        digits = self.config.max_digit + 1
        if mode == "eval":
            hidden = list(range(digits))[:n]  # every digit once
        elif mode == "train":
            rng = np.random.default_rng([seed, 0])
            hidden = [int(d) for d in rng.integers(0, digits, size=n)]
        else:
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        return [
            Problem(id=f"hidden-{d}", prompt="?", answer=str(d), info={"hidden": d}) for d in hidden
        ]

    def reset(self, problem: Problem) -> GuessEpisode:
        return GuessEpisode(int(problem.info["hidden"]), self.config)


def default_lessons(config: GuessEnvConfig) -> list[LessonConfig]:
    """One lesson: the game as configured. Each episode needs up to ``max_guesses`` turns of
    3 tokens (digit, stop, feedback) after a 2-token prompt: 14 tokens for 4 guesses, within
    the default model's ``max_seq_len`` of 16."""
    return [
        LessonConfig(
            id="guess_digit",
            env="guess",
            sampling=SamplingParams(temperature=1.0, max_tokens=2, n_prompts=32),
            eval_sampling=SamplingParams(
                temperature=0.0, max_tokens=2, n_prompts=10, n_generations_per_prompt=1
            ),
        )
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="guess",
        summary="Multi-turn: find a hidden digit in 4 guesses from higher/lower feedback.",
        config_class=GuessEnvConfig,
        build=GuessEnv,
        default_lessons=default_lessons,
    )
