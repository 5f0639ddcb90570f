"""The ``calculator_agent`` env: arithmetic questions answered by an unmodified OpenAI-client
tool-calling agent (``calculator_agent.py``), run as each episode's program.

marinrl gives every episode an OpenAI-compatible endpoint of its own on the rollout worker; the
agent script is started as a subprocess with that endpoint in ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` (``subprocess = true``, the default), or its ``solve`` loop is called in the
worker on a thread (``subprocess = false``: no process start per episode). Either way the agent
is the same code, and every call it makes is sampled from the policy being trained and recorded
token for token. The episode's reward is 1 when the last number of the agent's answer is the
question's value.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import numpy as np

from marin_rl_core import (
    AgentClients,
    AgentCommand,
    AgentEndpoint,
    EnvPlugin,
    LessonConfig,
    Problem,
    SamplingParams,
    Score,
    hookimpl,
)

AGENT = Path(__file__).with_name("calculator_agent.py")
_NUMBER = re.compile(r"-?\d+")


@attrs.frozen(kw_only=True)
class CalculatorAgentConfig:
    """Args:
    subprocess: run the agent script as a process per episode (else its loop on a thread).
    max_operand: operands are drawn from 2..max_operand.
    """

    subprocess: bool = True
    max_operand: int = attrs.field(default=99, validator=attrs.validators.ge(2))


class CalculatorAgentEnv:
    """Implements :class:`marin_rl_core.AgentEnv`."""

    def __init__(self, config: CalculatorAgentConfig):
        self.config = config
        self._clients = AgentClients()

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        rng = np.random.default_rng([seed, 0 if mode == "train" else 1])
        problems = []
        for _ in range(n):
            a, b, c = (int(x) for x in rng.integers(2, self.config.max_operand + 1, size=3))
            problems.append(
                Problem(id=f"{a}*{b}+{c}", prompt=f"what is {a}*{b}+{c}?", answer=str(a * b + c))
            )
        return problems

    def run_agent(self, problem: Problem, endpoint: AgentEndpoint):
        if self.config.subprocess:
            return AgentCommand(argv=[sys.executable, str(AGENT), problem.prompt])
        from calculator_agent import solve

        return solve(self._clients.sync(endpoint), endpoint.model, problem.prompt)

    def score(self, problem: Problem, result: str) -> Score:
        numbers = _NUMBER.findall(str(result))
        correct = bool(numbers) and numbers[-1] == problem.answer
        return Score(float(correct), {"answered": float(bool(numbers))})


def default_lessons(config: CalculatorAgentConfig) -> list[LessonConfig]:
    return [
        LessonConfig(
            id="calculator_agent",
            env="calculator_agent",
            sampling=SamplingParams(
                temperature=1.0, max_tokens=64, n_prompts=4, n_generations_per_prompt=4
            ),
            eval_sampling=SamplingParams(
                temperature=0.0, max_tokens=64, n_prompts=8, n_generations_per_prompt=1
            ),
        )
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="calculator_agent",
        summary="Agent: arithmetic questions answered by an OpenAI-client tool-calling agent.",
        config_class=CalculatorAgentConfig,
        build=CalculatorAgentEnv,
        default_lessons=default_lessons,
    )
