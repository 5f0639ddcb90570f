"""An episode's state while it runs (:class:`Live`), its result, the ways it fails, the
single-turn adapter (:func:`as_multi_turn`), and the token bookkeeping of each turn: an action's
tokens kept as sampled and recorded (:func:`take_action`), an observation's tokens appended after
them or a new training sample started (:func:`observe`), the episode's training samples built at
its end (:func:`episode_rollouts`).

The record is the same :class:`~marin_rl_core.rollout.transcript.Transcript` an agent
episode keeps of its calls (one bookkeeper of exact tokens): each action is a call whose prompt
is the episode's tokens so far, continuing the previous action's sample unless a chat template
rewrote the past (a ``"template"`` split: a new sample whose prompt is the fresh rendering)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from marin_rl_core.protocols import Env, Episode, MultiTurnEnv, is_agent_env
from marin_rl_core.rollout.transcript import Context, Transcript
from marin_rl_core.types import Action, Problem, Rollout, Step, as_score

# --- the single-turn adapter ----------------------------------------------------------------------


class _ScoredEpisode:
    """One step: score the action with the wrapped env's ``score``, and end."""

    def __init__(self, env: Env, problem: Problem):
        self._env, self._problem = env, problem

    def step(self, action: Action) -> Step:
        score = as_score(self._env.score(self._problem, action.text))
        return Step(reward=score.reward, done=True, metrics=score.metrics)


@attrs.frozen
class SingleTurnEpisodes:
    """A single-turn :class:`~marin_rl_core.protocols.Env` as a
    :class:`~marin_rl_core.protocols.MultiTurnEnv`; see :func:`as_multi_turn`."""

    env: Env
    single_turn = True  # the runner samples such a batch in one generate call

    def sample_problems(self, n: int, *, mode: Any, seed: int) -> list[Problem]:
        return self.env.sample_problems(n, mode=mode, seed=seed)

    def reset(self, problem: Problem) -> Episode:
        return _ScoredEpisode(self.env, problem)


def as_multi_turn(env: Env | MultiTurnEnv) -> MultiTurnEnv:
    """``env`` as a multi-turn env: itself if it has ``reset``, else a one-step episode per
    problem whose step calls ``env.score``. The rollout side applies it to every env; it is
    public for tests and for code that drives envs itself."""
    if callable(getattr(env, "reset", None)) or is_agent_env(env):
        return env  # type: ignore[return-value]  # an agent env runs its own episodes
    if not callable(getattr(env, "score", None)):
        raise TypeError(
            f"{type(env).__name__} has neither score() (a single-turn env) nor reset() (a "
            "multi-turn env); implement one of them"
        )
    return SingleTurnEpisodes(env)  # type: ignore[arg-type]


# --- limits and results ---------------------------------------------------------------------------


class EpisodeFailure(Exception):
    """An episode that cannot be trained on: ``kind`` is ``"error"`` or ``"timeout"``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class BatchCancelled(Exception):
    """The batch was cancelled (:meth:`EpisodeRunner.cancel`): its worker is stopping."""


@attrs.define
class EpisodeResult:
    """What one episode produced.

    Args:
        rollouts: its training samples (one unless a chat template forced a split), without
            metadata; empty when the episode failed.
        failure: ``None``, or why the episode failed.
        metrics: the last step's metrics.
        turns: actions taken.
        env_seconds: time spent in env calls (``reset`` and ``step``).
        env_step_seconds: time spent in ``step`` calls.
        env_calls: ``step`` calls (an agent episode's: its calls to the policy).
        splits: the episode's extra training samples, by reason (a chat template's rewrite,
            ``"template"``; an agent's ``"fork"`` or ``"branch"``:
            :class:`~marin_rl_core.rollout.transcript.Transcript`).
        weight_steps: ``(oldest, newest)`` weight step of the weights that sampled its tokens,
            when the engine says (it took new weights while rows decoded); ``None``: the
            batch's weights sampled all of it.
    """

    rollouts: list[Rollout] = attrs.field(factory=list)
    failure: EpisodeFailure | None = None
    metrics: dict[str, float] = attrs.field(factory=dict)
    turns: int = 0
    env_seconds: float = 0.0
    env_step_seconds: float = 0.0
    env_calls: int = 0
    splits: dict[str, int] = attrs.field(factory=dict)
    weight_steps: tuple[int, int] | None = None


@attrs.define(eq=False)
class Live:
    """The state of one running episode."""

    index: int  # problem_index * n + k
    problem: Problem
    episode: Any = None
    tokens: list[int] = attrs.field(factory=list)  # what the next action is sampled after
    transcript: Transcript = attrs.field(factory=Transcript)  # the actions, as sampled
    parent: int | None = None  # the recorded action ``tokens`` continue (None: a new sample)
    split: str | None = None  # why ``tokens`` do not continue it, if they do not
    messages: list[dict[str, str]] = attrs.field(factory=list)
    turn: int = 0
    truncated: bool = False
    deadline: float = float("inf")
    result: EpisodeResult = attrs.field(factory=EpisodeResult)


def span_weight_steps(
    steps: tuple[int, int] | None, more: tuple[int, int] | None
) -> tuple[int, int] | None:
    """The ``(oldest, newest)`` weight steps of two spans together (``None``: unknown)."""
    if steps is None or more is None:
        return more if steps is None else steps
    return min(steps[0], more[0]), max(steps[1], more[1])


def take_action(live: Live, sample: Any, stop_set: set[int], tokenizer: Any) -> Action:
    """Record a sampled action after the episode's tokens so far; the action as the env sees
    it."""
    tokens = np.asarray(sample.tokens, dtype=np.int64).reshape(-1).tolist()
    if not tokens:
        raise EpisodeFailure("error", "the sampler returned an empty action")
    steps, truncated = sample.weight_steps, not sample.stopped
    live.transcript.record(
        Context(live.tokens, live.parent, live.split),
        (),
        {},
        tokens,
        sample.logprobs,
        weight_step=steps[0] if steps else 0,
        truncated=truncated,
    )
    live.parent, live.split = len(live.transcript.calls) - 1, None
    live.tokens = [*live.tokens, *tokens]
    live.turn += 1
    live.result.weight_steps = span_weight_steps(live.result.weight_steps, steps)
    live.truncated = truncated
    text = tokenizer.decode([t for t in tokens if t not in stop_set])
    live.messages.append({"role": "assistant", "content": text})
    return Action(text=text, token_ids=tuple(tokens), truncated=truncated, turn=live.turn - 1)


def observe(live: Live, step: Step, *, tokenizer: Any, chat: bool) -> None:
    """Append the observation's tokens (or start a new training sample where the template
    would rewrite the past)."""
    observation = step.observation
    if not chat:
        if not isinstance(observation, str):  # no template: the messages' text, in order
            observation = "".join(m["content"] for m in observation)
        live.tokens.extend(int(t) for t in (tokenizer.encode(observation) if observation else []))
        return
    messages = (
        [{"role": "user", "content": observation}]
        if isinstance(observation, str)
        else [dict(m) for m in observation]
    )
    live.messages.extend(messages)
    rendered = [int(t) for t in tokenizer.encode_chat(live.messages)]
    if rendered[: len(live.tokens)] != live.tokens:
        # The template changes what came before: go on in a new training sample.
        live.parent, live.split = None, "template"
    live.tokens = rendered


def episode_rollouts(live: Live, *, env_name: str, lesson_id: str) -> list[Rollout]:
    """The finished episode's training samples (one unless a template split it), each with the
    episode's reward (the sum of its turn rewards) and whether it ended truncated."""
    calls = live.transcript.calls
    reward = float(sum(call.reward for call in calls))
    rollouts = live.transcript.rollouts(
        env_name=env_name, lesson_id=lesson_id, problem_id=live.problem.id, reward=reward
    )
    return [
        r if r.truncated == live.truncated else attrs.evolve(r, truncated=live.truncated)
        for r in rollouts
    ]


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of an episode's action at ``turn`` (a single-turn env's batch uses the
    batch seed instead, in one generate call); an agent episode's calls use it too."""
    return int(np.random.SeedSequence([seed % 2**32, episode, turn]).generate_state(1)[0] >> 1)


__all__ = [
    "BatchCancelled",
    "EpisodeFailure",
    "EpisodeResult",
    "Live",
    "SingleTurnEpisodes",
    "as_multi_turn",
    "episode_rollouts",
    "episode_seed",
    "observe",
    "take_action",
]
