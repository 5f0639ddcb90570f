"""A calculator agent written against the OpenAI client, the way one is written anywhere: it
knows nothing of marinrl. It asks the model a question with a `calculate` tool, runs every call
the model makes, sends the results back, and prints the model's final answer.

    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=... python calculator_agent.py "what is 12*7?"

marinrl's `calculator_agent` env (marinrl_agent_calculator.py) runs this very file as each
episode's program, with the episode's endpoint in OPENAI_BASE_URL / OPENAI_API_KEY.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "use the calculate tool for arithmetic, then give the number."
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an expression of integers, + - * and parentheses (parsed, never eval-ed),
    or an error message for the model."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            result = OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > 10**12:
                raise ValueError("too large")
            return result
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers, + - * and parentheses")

    try:
        return str(value(ast.parse(expression.strip()[:200], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


def solve(client: OpenAI, model: str, question: str, max_rounds: int = 4) -> str:
    """Ask, run the tools the model calls, ask again; the model's last answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(max_rounds):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
            )
    return ""


if __name__ == "__main__":
    with OpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        print(solve(client, os.environ.get("MARINRL_MODEL", "default"), sys.argv[1]))
