"""``countdown``: a multi-turn third-party marinrl env. Count a number down to exactly 0.

Each turn the policy takes 1..``max_take`` off the number; the env answers with what is left.
Landing on 0 wins (reward 1); taking more than is left, or running out of moves, loses (reward
0). One episode with the default model's arithmetic tokenizer, as tokens::

    <bos> 13   9 <eos>   4   4 <eos>        (13: take 9, "4 left"; take 4: 0 left, reward 1)

* the prompt is the starting number, and every observation is the number left, so the policy
  always sees the state of the game in its last token;
* a move is read from the action's decoded text: the whole number it starts with (``"9"``,
  ``" 9\\n"``; ``"take 9"`` is not a move); ``token_ids`` are not parsed (one number may be
  several tokens);
* an action without a number, or taking 0 or more than ``max_take``, is invalid: nothing is
  taken, the move is spent and the observation repeats the number left;
* a *truncated* action (cut off at ``max_tokens`` before its stop token: an unfinished answer)
  is invalid in eval. In training its number still counts, but a win with such a move earns
  only ``partial_credit``: a policy trained from scratch almost never stops right after a
  number by chance, and without the half credit it would see no reward to learn from;
* after ``max_moves`` moves the episode ends, lost. Set the run's ``episodes.max_turns`` to at
  least ``max_moves`` (``countdown.toml``), or the framework ends episodes early (truncated).

Eval poses every starting number once, in order (the held-out split of a procedural game: fixed
problems); training draws them at random. Score metrics: ``moves`` (moves taken), ``invalid``
(invalid moves), ``truncated`` (truncated actions) and ``won``.

The whole plugin is this module plus one entry point in ``pyproject.toml``. It imports only
marinrl's public surface, and nothing heavy, so ``marinrl plugins list`` stays fast.
"""

from __future__ import annotations

import random
import re

import attrs

from marin_rl_core import (
    Action,
    EnvPlugin,
    LessonConfig,
    LessonDependency,
    Problem,
    Step,
    hookimpl,
)

_LEADING_NUMBER = re.compile(r"\s*(\d+)")


@attrs.frozen(kw_only=True)
class CountdownConfig:
    """Args:
    min_start: the smallest starting number.
    max_start: the largest starting number (keep it below 100 for the arithmetic tokenizer,
        whose numbers 0-99 are one token each).
    max_take: the most a move may take.
    max_moves: moves per episode.
    partial_credit: training reward of a win in which a truncated action's number was taken;
        0 treats truncated actions as invalid in training too (as eval always does).
    """

    min_start: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    max_start: int = attrs.field(default=30, validator=attrs.validators.ge(1))
    max_take: int = attrs.field(default=9, validator=attrs.validators.ge(1))
    max_moves: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    partial_credit: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    def __attrs_post_init__(self) -> None:
        if self.max_start < self.min_start:
            raise ValueError(f"max_start ({self.max_start}) < min_start ({self.min_start})")


def read_move(text: str) -> int | None:
    """The whole number an action's decoded text (stop token already removed) starts with,
    spaces aside, or ``None``.

    Parse the text, not ``Action.token_ids``: one number may be several tokens (the arithmetic
    tokenizer cuts ``"123"`` into ``"12"``, ``"3"``; a Hugging Face tokenizer cuts it
    differently), and adjacent number tokens read as one number (``"5"``, ``"3"`` is ``"53"``).
    Only a *leading* number counts: with "the first number anywhere", a policy trained from
    scratch learns to pad its moves with junk (``"h5"``) and is never pushed to answer cleanly.
    """
    match = _LEADING_NUMBER.match(text)
    return int(match.group(1)) if match else None


class CountdownEpisode:
    """One game: the number left and the moves made so far.

    Args:
        start: the starting number.
        config: the env's config.
        strict: a truncated action is invalid (eval, or ``partial_credit = 0``).
    """

    def __init__(self, start: int, config: CountdownConfig, *, strict: bool):
        self.left = start
        self.config = config
        self.strict = strict
        self.moves = 0
        self.invalid = 0
        self.truncated = 0
        self.took_truncated = False

    def step(self, action: Action) -> Step:
        self.moves += 1
        take = read_move(action.text)
        if action.truncated:  # cut off at max_tokens (or by model.max_seq_len) before stopping
            self.truncated += 1
            if self.strict:
                take = None
            elif take is not None:
                self.took_truncated = True
        if take is None or not 1 <= take <= self.config.max_take:
            self.invalid += 1
            take = 0  # an invalid move takes nothing but still costs a move
        metrics = {
            "moves": float(self.moves),
            "invalid": float(self.invalid),
            "truncated": float(self.truncated),
        }
        if take > self.left:  # overshot: lost
            return Step(reward=0.0, done=True, metrics={**metrics, "won": 0.0})
        self.left -= take
        if self.left == 0:
            reward = self.config.partial_credit if self.took_truncated else 1.0
            return Step(reward=reward, done=True, metrics={**metrics, "won": 1.0})
        if self.moves >= self.config.max_moves:
            return Step(reward=0.0, done=True, metrics={**metrics, "won": 0.0})
        # The observation is encoded on its own (no BOS) and appended after the action's tokens.
        return Step(observation=str(self.left), reward=0.0, done=False, metrics=metrics)


class CountdownEnv:
    """Implements :class:`marin_rl_core.MultiTurnEnv`: ``sample_problems`` and ``reset``.

    No ``close(episode)``: an episode holds no resources. An env whose episodes hold a sandbox,
    a subprocess or a connection implements it; marinrl calls it once per episode.
    """

    def __init__(self, config: CountdownConfig):
        self.config = config

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        starts = range(self.config.min_start, self.config.max_start + 1)
        if mode == "eval":
            chosen = list(starts)[:n]  # every starting number once
        elif mode == "train":
            rng = random.Random(f"train-{seed}")
            chosen = [rng.choice(starts) for _ in range(n)]
        else:
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        return [
            Problem(
                id=f"train-{seed}-{i}" if mode == "train" else f"eval-{start}",
                prompt=str(start),
                # The best first move. marinrl's contract check steps each episode once with
                # ``Action(text=problem.answer)``, so make it an action the episode accepts.
                answer=str(min(start, self.config.max_take)),
                info={"start": start, "mode": mode},
            )
            for i, start in enumerate(chosen)
        ]

    def reset(self, problem: Problem) -> CountdownEpisode:
        strict = problem.info["mode"] == "eval" or self.config.partial_credit == 0
        return CountdownEpisode(int(problem.info["start"]), self.config, strict=strict)


def default_lessons(config: CountdownConfig) -> list[LessonConfig]:
    """Two lessons: first small numbers (1..``max_take``: one right move finishes them), then
    the game as configured, unlocked once the first reaches 0.5 in eval.

    No per-lesson ``sampling``: a lesson that sets it replaces the run's whole ``[sampling]``
    table for that lesson, so ``--set sampling.max_tokens=...`` would no longer reach it, and the
    right ``max_tokens`` depends on the model (2 for the default model, more for a chatty
    Hugging Face one). The run config sets it instead (``countdown.toml``).
    """
    small = {"min_start": 1, "max_start": min(config.max_take, config.max_start)}
    return [
        LessonConfig(id="countdown_small", env="countdown", env_config=small, stop_threshold=0.9),
        LessonConfig(
            id="countdown",
            env="countdown",
            dependencies=[LessonDependency(lesson="countdown_small", reward_threshold=0.5)],
            stop_threshold=0.9,
        ),
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="countdown",
        summary="Multi-turn: count a number down to exactly 0, told what is left after each move.",
        config_class=CountdownConfig,
        build=CountdownEnv,
        default_lessons=default_lessons,
    )
