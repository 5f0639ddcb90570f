"""The ``calculator`` env: arithmetic word problems the policy may solve with a calculator tool.

A multi-turn, tool-using env for models with a Hugging Face tokenizer (and chat template). Each
turn the policy either calls the tool or answers::

    user:       Ana has 37 boxes of 48 pens and gives away 12 pens. How many pens are left?
    assistant:  <calc>37*48-12</calc>
    tool:       1764
    assistant:  The answer is \\boxed{1764}.

* a tool call is ``<calc>EXPRESSION</calc>`` anywhere in the action: numbers, ``+ - * /``,
  parentheses and spaces. The result goes back as a ``tool`` message (a model without a chat
  template sees its text); a malformed expression gets an error message instead.
  Expressions are parsed with :mod:`ast` into those operations only: nothing is ``eval``-ed.
* an action without a tool call is the final answer: the number in its last ``\\boxed{...}``
  (else its last number) is compared with the reference. Reward 1 if equal, else 0.
* after ``max_tool_calls`` calls the next action must answer; one more call ends the episode
  with reward 0.

Score metrics: ``tool_calls`` (calls made), ``correct``. Problems are drawn from templates with
random numbers (``difficulty`` sets how many operations); eval problems come from a disjoint
seed stream.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

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

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
MAX_DIGITS = 30
"""A result longer than this is refused (``9**9**9`` cannot be written: there is no power)."""


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression`` (numbers, ``+ - * /``, parentheses).

    Raises:
        ValueError: anything else (names, calls, powers, attributes), division by zero, or a
            result of more than :data:`MAX_DIGITS` digits.
    """
    if len(expression) > 200:
        raise ValueError("expression too long (200 characters at most)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            result = _OPS[type(node.op)](left, right)
            if len(str(abs(result.numerator))) > MAX_DIGITS:
                raise ValueError("result too large")
            return result
        raise ValueError(
            f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}"
        )

    return value(tree)


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


_TEMPLATES = (
    (
        "{name} has {a} boxes of {b} pens and gives away {c} pens. How many pens are left?",
        "{a}*{b}-{c}",
    ),
    (
        "A train travels {a} km each day for {b} days, then {c} km more. How far does it go?",
        "{a}*{b}+{c}",
    ),
    (
        "{name} shares {p} sweets equally among {a} children. How many does each child get?",
        "{p}/{a}",
    ),
    (
        "A shop sells {a} shirts at {b} dollars and {c} hats at {d} dollars. What is the total?",
        "{a}*{b}+{c}*{d}",
    ),
)
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi")


@attrs.frozen(kw_only=True)
class CalculatorEnvConfig:
    """Args:
    max_tool_calls: calculator calls allowed per episode.
    max_operand: the largest number in a problem.
    """

    max_tool_calls: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    max_operand: int = attrs.field(default=99, validator=attrs.validators.ge(2))


class CalculatorEpisode:
    def __init__(self, problem: Problem, config: CalculatorEnvConfig):
        self.answer = Fraction(problem.answer)
        self.config = config
        self.calls = 0

    def step(self, action: Action) -> Step:
        call = _CALL.search(action.text)
        if call is not None:
            self.calls += 1
            metrics = {"tool_calls": float(self.calls)}
            if self.calls > self.config.max_tool_calls:
                return Step(reward=0.0, done=True, metrics={**metrics, "correct": 0.0})
            try:
                result = format_number(calculate(call.group(1)))
            except ValueError as exc:
                result = f"error: {exc}"
            return Step(observation=({"role": "tool", "content": result},), metrics=metrics)
        boxed = _BOXED.findall(action.text)
        numbers = _NUMBER.findall(boxed[-1] if boxed else action.text)
        correct = bool(numbers) and Fraction(numbers[-1]) == self.answer
        return Step(
            reward=float(correct),
            done=True,
            metrics={"tool_calls": float(self.calls), "correct": float(correct)},
        )


class CalculatorEnv:
    """Implements :class:`marin_rl_core.MultiTurnEnv`; see the module docstring."""

    def __init__(self, config: CalculatorEnvConfig):
        self.config = config

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        rng = np.random.default_rng([seed, 0 if mode == "train" else 1, 17])
        top = self.config.max_operand
        problems = []
        for _ in range(n):
            text, formula = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
            a, b, c, d = (int(x) for x in rng.integers(2, top + 1, size=4))
            values = {
                "a": a,
                "b": b,
                "c": c,
                "d": d,
                "p": a * b,
                "name": _NAMES[int(rng.integers(len(_NAMES)))],
            }
            answer = format_number(calculate(formula.format(**values)))
            prompt = (
                text.format(**values)
                + " You may call a calculator by writing <calc>EXPRESSION</calc>; give the final"
                " answer as \\boxed{NUMBER}."
            )
            problems.append(
                Problem(id=f"calc:{formula.format(**values)}", prompt=prompt, answer=answer)
            )
        return problems

    def reset(self, problem: Problem) -> CalculatorEpisode:
        return CalculatorEpisode(problem, self.config)


def default_lessons(config: CalculatorEnvConfig) -> list[LessonConfig]:
    """One lesson; tool calls and answers need room: 64 tokens per action."""
    return [
        LessonConfig(
            id="calculator",
            env="calculator",
            sampling=SamplingParams(temperature=1.0, max_tokens=64, n_prompts=16),
            eval_sampling=SamplingParams(
                temperature=0.0, max_tokens=64, n_generations_per_prompt=1
            ),
        )
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="calculator",
        summary="Multi-turn tool use: word problems with a <calc> calculator tool (HF models).",
        config_class=CalculatorEnvConfig,
        build=CalculatorEnv,
        default_lessons=default_lessons,
    )
