"""The calculator agent env's own tests: marinrl's contract checks, the tool, the grading.

Run them with the package installed: ``pip install -e . && pytest`` (in this directory).
"""

from __future__ import annotations

import sys

import marinrl_agent_calculator
from calculator_agent import calculate
from marinrl_agent_calculator import CalculatorAgentConfig, CalculatorAgentEnv

from marin_rl_core import AgentCommand, AgentEndpoint, Problem
from marin_rl_core.testing import check_plugin


def test_the_env_honours_the_contract(plugin_registry):
    registry = plugin_registry(marinrl_agent_calculator)
    assert registry.names("env") == ["calculator_agent"]
    check_plugin(registry.get("env", "calculator_agent"))


def test_the_tool_computes_and_refuses_anything_but_arithmetic():
    assert calculate("12*7+3") == "87" and calculate("-(2-5)*4") == "12"
    for bad in ["__import__('os')", "2**999999", "open('x')", "1/0", "9" * 5 + "*" + "9" * 9]:
        assert calculate(bad).startswith("error"), bad


def test_the_answer_is_the_last_number_and_held_out_problems_differ():
    env = CalculatorAgentEnv(CalculatorAgentConfig())
    (problem,) = env.sample_problems(1, mode="train", seed=0)
    assert env.score(problem, f"it is {problem.answer}").reward == 1.0
    assert env.score(problem, f"{problem.answer}, no: 3").reward == 0.0
    assert env.score(problem, "no idea").metrics == {"answered": 0.0}
    train = {p.id for p in env.sample_problems(50, mode="train", seed=1)}
    held_out = {p.id for p in env.sample_problems(50, mode="eval", seed=1)}
    assert train != held_out


def test_each_episode_runs_the_unmodified_agent_script():
    env = CalculatorAgentEnv(CalculatorAgentConfig())
    problem = Problem(id="p", prompt="what is 2*3+1?", answer="7")
    command = env.run_agent(problem, AgentEndpoint(base_url="http://x/v1", api_key="k"))
    assert isinstance(command, AgentCommand)
    assert command.argv[0] == sys.executable and command.argv[1].endswith("calculator_agent.py")
    assert command.argv[2] == problem.prompt
