"""The calculator tool env: safe arithmetic, tool calls answered as tool messages, answers graded."""

from __future__ import annotations

from fractions import Fraction

import pytest
from marin_rl_plugins.calculator_env import (
    CalculatorEnv,
    CalculatorEnvConfig,
    calculate,
)

from marin_rl_core import Action, Step


def test_calculate_is_exact_arithmetic_and_nothing_else():
    assert calculate("37*48-12") == 1764
    assert calculate(" (1 + 2) / 4 ") == Fraction(3, 4)
    assert calculate("-3 * -2.5") == Fraction(15, 2)
    for bad, why in [
        ("__import__('os').system('true')", "only numbers"),
        ("2**10", "only numbers"),
        ("a + 1", "only numbers"),
        ("1/0", "division by zero"),
        ("99999999999*99999999999*99999999999", "too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "too long"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculate(bad)


def test_an_episode_calls_the_tool_then_answers():
    env = CalculatorEnv(CalculatorEnvConfig(max_tool_calls=2))
    problem = env.sample_problems(1, mode="train", seed=0)[0]
    expression = problem.id.removeprefix("calc:")
    assert Fraction(problem.answer) == calculate(expression)
    assert "<calc>" in problem.prompt and "\\boxed" in problem.prompt

    episode = env.reset(problem)
    step = episode.step(Action(text=f"Let me compute. <calc>{expression}</calc>"))
    assert step == Step(
        observation=({"role": "tool", "content": problem.answer},), metrics={"tool_calls": 1.0}
    )
    broken = episode.step(Action(text="<calc>import os</calc>"))
    assert broken.observation[0]["content"].startswith("error: not an arithmetic expression")
    done = episode.step(Action(text=f"So the answer is \\boxed{{{problem.answer}}}."))
    assert done.done and done.reward == 1.0 and done.metrics == {"tool_calls": 2.0, "correct": 1.0}

    wrong = env.reset(problem).step(Action(text="\\boxed{1}"))
    assert wrong.done and wrong.reward == 0.0


def test_too_many_tool_calls_end_the_episode_unrewarded():
    env = CalculatorEnv(CalculatorEnvConfig(max_tool_calls=1))
    episode = env.reset(env.sample_problems(1, mode="eval", seed=3)[0])
    assert not episode.step(Action(text="<calc>1+1</calc>")).done
    last = episode.step(Action(text="<calc>2+2</calc>"))
    assert last.done and last.reward == 0.0 and last.metrics["tool_calls"] == 2.0


def test_train_and_eval_problems_differ():
    env = CalculatorEnv(CalculatorEnvConfig())
    train = {p.id for p in env.sample_problems(50, mode="train", seed=0)}
    held_out = {p.id for p in env.sample_problems(50, mode="eval", seed=0)}
    assert len(train & held_out) < 5
