"""Tool calls in a sampled reply, in the model family's own format, as the OpenAI API returns
them (``message.tool_calls``, ``finish_reason = "tool_calls"``).

Qwen2.5/Qwen3 and the Hermes-style templates (``<tool_call>`` blocks holding
``{"name": ..., "arguments": {...}}``) are parsed here; their chat templates render the
``tool_calls`` of an assistant message back into the same blocks, so a conversation the agent
sends back renders to the tokens the policy sampled (:mod:`~marin_rl_core.rollout.transcript`
checks it). A block that is not valid JSON, or lacks a name, is left in the text: the agent sees
what the policy wrote, and the call is not invented.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@attrs.frozen
class ParsedReply:
    """``content``: the text outside tool call blocks (``None`` when only calls remain);
    ``tool_calls``: OpenAI-style ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` dicts (``arguments`` a JSON string, as the API gives it)."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_tool_calls(text: str, *, call_id_prefix: str = "call") -> ParsedReply:
    """Split ``text`` into its prose and its ``<tool_call>`` blocks (see the module
    docstring); call ids are ``{call_id_prefix}_{k}``."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"{call_id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": body["name"], "arguments": arguments},
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return ParsedReply(content=content or None, tool_calls=calls)
