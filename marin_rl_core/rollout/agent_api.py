"""The OpenAI API as the agent endpoint speaks it (:mod:`marin_rl_core.rollout.agent_server`):
requests checked and read into :class:`Request` s, sampled choices written back as chat
completions, text completions or server-sent event chunks.

What the endpoint refuses, and why (each with a 400 naming the parameter):

* ``top_p < 1``, ``top_k > 0``, penalties and ``logit_bias``: the policy's samples would come
  from another distribution than the one the trainer computes log-probabilities of, and every
  importance ratio of the update would be wrong;
* ``tool_choice`` other than ``"auto"`` / ``"none"``, a ``response_format`` other than text:
  they need constrained decoding, which the samplers do not do;
* ``top_logprobs > 0``: alternatives are not computed (the sampled token's log-probability is);
* several prompts in one text completion, ``echo``, ``suffix``: not needed by agents.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from marin_rl_core.rollout.tool_calls import parse_tool_calls

MAX_N = 16
"""The most choices one request may ask for (``n``)."""

_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the endpoint answers with an error (OpenAI's error body)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 - the API's field name
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@attrs.frozen(kw_only=True)
class Request:
    """A checked request. ``kind``: ``"chat"`` or ``"completion"``; ``messages`` and ``tools``
    (chat) or ``prompt`` (text or ids) say what to sample from."""

    kind: str
    model: str
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    prompt: str | list[int] | None = None
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(f"{name} must be an integer, got {value!r}", name)
    return value


def _text(content: Any, where: str) -> str | None:
    """A message's content as text (a list of text parts is joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise _bad(f"{where}: only text content parts are supported", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise _bad(f"{where}: content must be a string or a list of text parts", "messages")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] needs a role, one of {', '.join(_ROLES)}", "messages")
        kept = {
            k: message[k] for k in ("role", "name", "tool_calls", "tool_call_id") if message.get(k)
        }
        kept["content"] = _text(message.get("content"), f"messages[{i}]")
        calls = kept.get("tool_calls")
        if calls is not None and (
            not isinstance(calls, list)
            or not all(
                isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls
            )
        ):
            raise _bad(f"messages[{i}].tool_calls must be a list of function calls", "messages")
        out.append(kept)
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, Mapping)
        and isinstance(t.get("function"), Mapping)
        and t["function"].get("name")
        for t in value
    ):
        raise _bad("tools must be a list of {type: function, function: {name, ...}}", "tools")
    return [dict(t) for t in value] or None


def _refuse_other_sampling(body: Mapping[str, Any]) -> None:
    why = (
        "the trainer computes log-probabilities of the full softmax at the sampling temperature, "
        "so sampling from another distribution would make every importance ratio wrong"
    )
    top_p = body.get("top_p")
    if top_p is not None and top_p != 1:
        raise _bad(f"top_p={top_p!r} is not supported (only 1): {why}", "top_p")
    top_k = body.get("top_k")
    if top_k not in (None, 0, -1):
        raise _bad(f"top_k={top_k!r} is not supported (only 0 or -1: all tokens): {why}", "top_k")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0) and not (name == "repetition_penalty" and value == 1):
            raise _bad(f"{name}={value!r} is not supported: {why}", name)
    if body.get("logit_bias"):
        raise _bad(f"logit_bias is not supported: {why}", "logit_bias")
    if body.get("top_logprobs"):
        raise _bad(
            "top_logprobs > 0 is not supported: only the sampled tokens' log-probabilities are "
            "computed (logprobs=true returns them)",
            "top_logprobs",
        )


def parse_request(
    kind: str,
    body: Any,
    *,
    default_temperature: float,
    default_max_tokens: int,
) -> Request:
    """Check ``body`` (the parsed JSON of a ``/v1/chat/completions`` or ``/v1/completions``
    request) and read it; parameters it does not set take the lesson's defaults.

    Raises:
        APIError: 400, naming the parameter, for anything the endpoint cannot honour.
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    _refuse_other_sampling(body)
    n = _integer(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise _bad(f"n must be in 1..{MAX_N}, got {n}", "n")
    temperature = _number(body, "temperature", default_temperature)
    if temperature < 0:
        raise _bad(f"temperature must be >= 0, got {temperature}", "temperature")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a string or a list of up to 4 non-empty strings", "stop")
    seed = _integer(body, "seed")
    stream = bool(body.get("stream") or False)
    options = body.get("stream_options") or {}
    common: dict[str, Any] = dict(
        kind=kind,
        model=str(body.get("model") or ""),
        n=n,
        temperature=temperature,
        max_tokens=max_tokens,
        stop=tuple(stop),
        seed=seed,
        stream=stream,
        include_usage=bool(isinstance(options, Mapping) and options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids") or False),
    )
    if kind == "chat":
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise _bad(
                f"tool_choice={choice!r} is not supported (only 'auto' or 'none'): forcing a call "
                "needs constrained decoding",
                "tool_choice",
            )
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise _bad(
                "response_format other than text is not supported: it needs constrained decoding",
                "response_format",
            )
        if body.get("functions") or body.get("function_call"):
            raise _bad("functions/function_call are deprecated: pass tools", "functions")
        tools = _tools(body.get("tools"))
        return Request(
            messages=_messages(body.get("messages")),
            tools=tools,
            parse_tools=bool(tools) and choice != "none",
            logprobs=bool(body.get("logprobs") or False),
            **common,
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt given as a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad(
                "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
            )
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt must be a non-empty string or a list of token ids", "prompt")
    if body.get("echo") or body.get("suffix"):
        raise _bad("echo and suffix are not supported", "echo" if body.get("echo") else "suffix")
    best_of = _integer(body, "best_of")
    if best_of not in (None, n):
        raise _bad("best_of is not supported (only best_of = n)", "best_of")
    logprobs = _integer(body, "logprobs")
    return Request(prompt=prompt, logprobs=logprobs is not None, **common)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: ``developer`` as ``system``, a tool call's
    ``arguments`` as an object (Qwen's templates write it with ``tojson``; the API carries a
    JSON string), no ``None`` content."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "developer":
            message["role"] = "system"
        if message.get("content") is None:
            message["content"] = ""
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


# --- responses -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Choice:
    """One sampled choice, ready to write back: its ``content`` (``None`` when only tool calls
    remain), ``tool_calls``, ``finish_reason``, the ids it returns and their log-probabilities
    and token texts."""

    content: str | None
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list)
    finish_reason: str
    token_ids: list[int]
    logprobs: list[float]
    token_texts: list[str]


def make_choice(
    request: Request,
    sample: Any,
    stop_ids: Sequence[int],
    decode: Any,
    *,
    call_id: str,
) -> tuple[Choice, list[int], list[float]]:
    """A sample (:class:`~marin_rl_core.rollout.inference.Sample`) as the agent sees it, and the
    ids and log-probabilities recorded for it: the text without the stop token, cut before the
    first ``stop`` string (the ids after the token that completes it are dropped: never seen,
    never trained), and, for a request with ``tools``, its tool calls parsed out
    (``finish_reason = "tool_calls"``). ``decode``: the tokenizer's."""
    ids = [int(t) for t in sample.tokens]
    logprobs = [float(x) for x in sample.logprobs]
    stopped = bool(sample.stopped)
    visible = ids[:-1] if stopped and ids and ids[-1] in stop_ids else ids
    text = decode(visible)
    if request.stop:
        found = [(text.find(s), s) for s in request.stop if s in text]
        if found:
            at, stop = min(found)
            end = at + len(stop)
            k = next(k for k in range(1, len(visible) + 1) if len(decode(visible[:k])) >= end)
            ids, logprobs, visible = ids[:k], logprobs[:k], visible[:k]
            text, stopped = text[:at], True
    finish = "stop" if stopped else "length"
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if request.parse_tools and finish == "stop":
        parsed = parse_tool_calls(text, call_id_prefix=call_id)
        if parsed.tool_calls:
            content, calls, finish = parsed.content, parsed.tool_calls, "tool_calls"
    texts = [decode([t]) for t in ids] if request.logprobs else []
    choice = Choice(
        content=content,
        tool_calls=calls,
        finish_reason=finish,
        token_ids=ids,
        logprobs=logprobs,
        token_texts=texts,
    )
    return choice, ids, logprobs


def _chat_logprobs(choice: Choice) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(choice.token_texts, choice.logprobs)
        ],
        "refusal": None,
    }


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


def _completion_logprobs(choice: Choice) -> dict[str, Any]:
    offsets, at = [], 0
    for text in choice.token_texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": choice.token_texts,
        "token_logprobs": choice.logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def response_body(
    request: Request,
    *,
    response_id: str,
    created: int,
    model: str,
    prompt_ids: list[int],
    choices: Sequence[Choice],
) -> dict[str, Any]:
    """A ``chat.completion`` object for a chat request, a ``text_completion`` one for a text
    completion."""
    chat = request.kind == "chat"
    out_choices = []
    for i, choice in enumerate(choices):
        item: dict[str, Any] = {"index": i}
        if chat:
            item["message"] = _message(choice)
            item["logprobs"] = _chat_logprobs(choice) if request.logprobs else None
        else:
            item["text"] = choice.content or ""
            item["logprobs"] = _completion_logprobs(choice) if request.logprobs else None
        item["finish_reason"] = choice.finish_reason
        if request.return_token_ids:
            item["prompt_token_ids"] = prompt_ids
            item["completion_token_ids"] = choice.token_ids
        out_choices.append(item)
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": out_choices,
        "usage": _usage(len(prompt_ids), choices),
    }


def stream_events(request: Request, response: dict[str, Any]) -> list[str]:
    """The response as server-sent events (produced after generation): per choice a chunk with
    its role, its text, its tool calls and its finish reason; the usage when asked for; then
    ``[DONE]``."""
    chat = request.kind == "chat"
    base = {
        "id": response["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": response["created"],
        "model": response["model"],
    }
    chunks: list[dict[str, Any]] = []
    for choice in response["choices"]:
        index = choice["index"]
        if chat:
            message = choice["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
            first = {"index": index, "delta": delta, "logprobs": choice["logprobs"]}
            if "completion_token_ids" in choice:
                first["prompt_token_ids"] = choice["prompt_token_ids"]
                first["completion_token_ids"] = choice["completion_token_ids"]
            chunks.append({**base, "choices": [{**first, "finish_reason": None}]})
            if message.get("tool_calls"):
                calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                chunks.append(
                    {
                        **base,
                        "choices": [
                            {"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}
                        ],
                    }
                )
            end = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}
            chunks.append({**base, "choices": [end]})
        else:
            chunks.append({**base, "choices": [dict(choice)]})
    if request.include_usage:
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


__all__ = [
    "MAX_N",
    "APIError",
    "Choice",
    "Request",
    "response_body",
    "make_choice",
    "parse_request",
    "stream_events",
    "template_messages",
]
