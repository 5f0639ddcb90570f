"""The ``guess_agent`` env: the ``guess`` game played by an agent program written against the
OpenAI client, through the rollout worker's agent endpoint (docs/agents.md).

The agent is the loop anyone would write: send the game so far as a text completion, read the
guess from the reply, play it, append the guess and the feedback, and ask again::

    prompt = "?"
    for _ in range(max_guesses):
        guess = client.completions.create(model=..., prompt=prompt).choices[0].text
        feedback = game.play(guess)        # "<", ">" or "?"; or the game ends
        prompt += guess + feedback

It knows nothing of tokens, weights or rewards: the endpoint records the ids the policy saw and
sampled (the stop token after each guess included, exactly as the in-process ``guess`` env's
episodes hold them), and the game's result is the episode's score. Seed for seed it samples the
rollouts of ``guess`` (``tests/test_agent_endpoint.py``); its learning bar is
``tests/test_agent_learning.py`` (docs/agents.md#learning).

``client = "async"`` (the default) runs each agent as a coroutine with ``openai.AsyncOpenAI`` on
the worker's event loop; ``"sync"`` runs it on a thread with ``openai.OpenAI``; ``"subprocess"``
runs ``python -m marin_rl_plugins.guess_agent_env HIDDEN`` with the endpoint in its environment
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), its last line of output being its reward.
"""

from __future__ import annotations

import sys

import attrs
from marin_rl_plugins.guess_env import GuessEnv, GuessEnvConfig, GuessEpisode
from marin_rl_plugins.guess_env import default_lessons as guess_lessons

from marin_rl_core import (
    Action,
    AgentClients,
    AgentCommand,
    AgentEndpoint,
    EnvPlugin,
    LessonConfig,
    Problem,
    Score,
    hookimpl,
)


@attrs.frozen(kw_only=True)
class GuessAgentEnvConfig:
    """Args:
    max_digit: the hidden digit is drawn from ``0..max_digit`` (at most 9).
    max_guesses: guesses per episode.
    client: ``"async"``, ``"sync"`` or ``"subprocess"`` (see the module docstring).
    """

    max_digit: int = attrs.field(
        default=9, validator=[attrs.validators.ge(1), attrs.validators.le(9)]
    )
    max_guesses: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    client: str = attrs.field(
        default="async", validator=attrs.validators.in_(("async", "sync", "subprocess"))
    )


def _game(hidden: int, max_digit: int, max_guesses: int) -> GuessEpisode:
    return GuessEpisode(hidden, GuessEnvConfig(max_digit=max_digit, max_guesses=max_guesses))


def play(client, model: str, game: GuessEpisode) -> Score:
    """The agent's loop with a synchronous OpenAI client; the game's score."""
    prompt = "?"
    while True:
        guess = client.completions.create(model=model, prompt=prompt).choices[0].text
        step = game.step(Action(text=guess))
        if step.done:
            return Score(step.reward, step.metrics)
        prompt += guess + str(step.observation)


async def play_async(client, model: str, game: GuessEpisode) -> Score:
    """The same loop with ``openai.AsyncOpenAI``."""
    prompt = "?"
    while True:
        reply = await client.completions.create(model=model, prompt=prompt)
        guess = reply.choices[0].text
        step = game.step(Action(text=guess))
        if step.done:
            return Score(step.reward, step.metrics)
        prompt += guess + str(step.observation)


class GuessAgentEnv:
    """Implements :class:`marin_rl_core.AgentEnv`; see the module docstring."""

    def __init__(self, config: GuessAgentEnvConfig):
        self.config = config
        self._clients = AgentClients()
        self._problems = GuessEnv(
            GuessEnvConfig(max_digit=config.max_digit, max_guesses=config.max_guesses)
        )

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        return self._problems.sample_problems(n, mode=mode, seed=seed)

    def run_agent(self, problem: Problem, endpoint: AgentEndpoint):
        hidden = int(problem.info["hidden"])
        if self.config.client == "subprocess":
            argv = [sys.executable, "-m", "marin_rl_plugins.guess_agent_env", str(hidden)]
            argv += [str(self.config.max_digit), str(self.config.max_guesses)]
            return AgentCommand(argv=argv)
        game = _game(hidden, self.config.max_digit, self.config.max_guesses)
        if self.config.client == "sync":
            return play(self._clients.sync(endpoint), endpoint.model, game)
        return play_async(self._clients.asynchronous(endpoint), endpoint.model, game)

    def score(self, problem: Problem, result) -> Score:
        """A subprocess's result is its output, whose last line is the reward; the in-process
        agents return the game's :class:`Score` itself."""
        if isinstance(result, Score):
            return result
        return Score(float(str(result).strip().splitlines()[-1]))


def default_lessons(config: GuessAgentEnvConfig) -> list[LessonConfig]:
    """One lesson, ``guess_agent``, sampled as the ``guess`` env's ``guess_digit`` is."""
    (lesson,) = guess_lessons(GuessEnvConfig())
    return [attrs.evolve(lesson, id="guess_agent", env="guess_agent")]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="guess_agent",
        summary="Agent: the guess game played by an OpenAI-client program through the endpoint.",
        config_class=GuessAgentEnvConfig,
        build=GuessAgentEnv,
        default_lessons=default_lessons,
    )


def main(argv: list[str]) -> None:
    """The subprocess agent: ``HIDDEN [MAX_DIGIT MAX_GUESSES]``; prints the reward."""
    from openai import OpenAI

    hidden = int(argv[0])
    max_digit, max_guesses = (int(argv[1]), int(argv[2])) if len(argv) > 2 else (9, 4)
    import os

    with OpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
        score = play(
            client, os.environ.get("MARINRL_MODEL", "policy"), _game(hidden, max_digit, max_guesses)
        )
    print(score.reward)


if __name__ == "__main__":
    main(sys.argv[1:])
