"""The token-exact record of one agent episode: every call the agent made to the policy through
the OpenAI-compatible endpoint (issue 30), as the ids the policy saw and sampled, and the training
samples (:class:`~marin_rl_core.types.Rollout`) built from them.

An agent sends its whole conversation with each call. Re-tokenizing or re-templating that
conversation at the end would not give back the ids the policy sampled (a sampled action need
not be the canonical encoding of its text; templates rewrite past turns), and training on other
ids than the sampled ones biases the gradient. So the transcript keeps each call's prompt ids,
completion ids and log-probabilities, and builds the prompt of a new call from them:

* The new call's messages are matched against the recorded calls: the longest recorded call
  whose messages plus its reply are a prefix of the new messages is the one continued.
* The new prompt is the chat template's rendering of the new messages; it must *extend* the
  continued call's prompt + completion ids (the extension property multi-turn episodes rely on,
  :mod:`~marin_rl_core.rollout.episode_state`). The new call then continues that call's training
  sample: one sample holds every turn, the policy's tokens masked in, exactly as sampled.
* Otherwise a new sample (``Rollout.part``) starts whose prompt is the fresh rendering, and the
  reason is counted (:attr:`Transcript.splits`): ``"fork"`` (the history is not a prefix of any
  recorded conversation: the agent edited or dropped messages), ``"template"`` (the template
  rewrites recorded ids: e.g. one that drops past reasoning) or ``"branch"`` (a recorded call is
  continued a second time, or its conversation is asked again: ``n > 1`` choices, a retry, or
  the agent went back). Nothing drifts: every
  sampled id is trained exactly once, in the sample it was sampled in, with its log-probability.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core.types import Rollout

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def canonical_message(message: Mapping[str, Any]) -> str:
    """A message as compared between calls: its role, text, name, tool calls and tool call id
    (what the template renders), without the fields an OpenAI client adds or drops (``None``
    values, ``refusal``, ``audio``, ...). Text given as a list of ``{"type": "text"}`` parts is
    joined."""
    out: dict[str, Any] = {}
    for key in _MESSAGE_KEYS:
        value = message.get(key)
        if key == "content" and isinstance(value, list):
            value = "".join(p.get("text", "") for p in value if isinstance(p, Mapping))
        if key == "tool_calls" and value:
            value = [
                {
                    "id": call.get("id"),
                    "name": call.get("function", {}).get("name"),
                    "arguments": call.get("function", {}).get("arguments"),
                }
                for call in value
            ]
        if value not in (None, "", []):
            out[key] = value
    if not out:  # (every framework episode's action: no messages; json.dumps costs 5 us)
        return "{}"
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


@attrs.define
class Context:
    """The prompt of a call about to be sampled: its ids, the recorded call it continues (index,
    or ``None``) and, where it cannot continue one, why (a key of :attr:`Transcript.splits`)."""

    ids: list[int]
    parent: int | None
    reason: str | None


@attrs.define
class Call:
    """One recorded call (one choice of it)."""

    messages: list[str]  # canonical messages of the request
    reply: str  # the canonical assistant message returned
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_step: int
    truncated: bool  # finish_reason "length"
    part: int = -1
    text: str | None = None  # a text completion's prompt + returned text (``None`` for chat)
    reward: float = 0.0  # the env's reward for this action (a multi-turn env's step reward)


class Transcript:
    """The calls of one episode: an agent's calls through the endpoint, or the actions of an
    episode the framework runs (:mod:`~marin_rl_core.rollout.episode_state`), which records
    each with the context it knows it continues.

    Args:
        render: the chat template: ``render(messages, tools)`` (OpenAI-style dicts; the
            request's ``tools`` or ``None``) to the prompt's token ids, ending with the opening
            of the assistant's turn (needed by :meth:`context` only).
    """

    def __init__(self, render: Callable[[list[dict[str, Any]], Any], list[int]] | None = None):
        self._render = render
        self.calls: list[Call] = []
        self.parts: list[list[int]] = []
        """Each training sample's calls, in order (indices into :attr:`calls`)."""
        self.splits: Counter[str] = Counter()

    def _continued(self, canon: list[str]) -> int | None:
        """The recorded call whose messages plus reply are the longest prefix of ``canon``."""
        best, best_len = None, -1
        for i, call in enumerate(self.calls):
            n = len(call.messages) + 1
            if best_len < n <= len(canon) and canon[: n - 1] == call.messages:
                if canon[n - 1] == call.reply:
                    best, best_len = i, n
        return best

    def context(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> Context:
        """The prompt ids for a call with ``messages`` and ``tools`` (see the module
        docstring; tools that change between calls change the rendering: a split)."""
        assert self._render is not None, "a transcript without a template has no context()"
        ids = [int(t) for t in self._render([dict(m) for m in messages], tools)]
        if not self.calls:
            return Context(ids, None, None)
        canon = [canonical_message(m) for m in messages]
        parent = self._continued(canon)
        if parent is None:  # the same conversation asked again is a branch of it, not a fork
            again = any(call.messages == canon for call in self.calls)
            return Context(ids, None, "branch" if again else "fork")
        recorded = self.calls[parent].prompt_ids + self.calls[parent].completion_ids
        if ids[: len(recorded)] != recorded:
            return Context(ids, None, "template")
        return Context(ids, parent, None)

    def context_text(self, text: str, encode: Callable[[str, bool], list[int]]) -> Context:
        """The prompt ids of a text completion (``/v1/completions``) whose prompt is ``text``:
        where a recorded completion's prompt + returned text starts ``text`` (the longest), its
        recorded ids followed by ``encode(rest, False)`` (the rest encoded on its own, no BOS):
        the ids the policy sampled are reused, never re-tokenized. Otherwise ``encode(text,
        True)`` (with BOS), a new sample."""
        best, best_len = None, -1
        for i, call in enumerate(self.calls):
            if call.text is not None and len(call.text) > best_len and text.startswith(call.text):
                best, best_len = i, len(call.text)
        if best is None:
            return Context(encode(text, True), None, "fork" if self.calls else None)
        call = self.calls[best]
        rest = text[best_len:]
        ids = call.prompt_ids + call.completion_ids + (encode(rest, False) if rest else [])
        return Context(ids, best, None)

    def context_ids(self, ids: Sequence[int]) -> Context:
        """The context of a completion whose prompt is given as token ids: it continues the
        recorded call whose prompt + completion ids start ``ids`` (the longest)."""
        ids = [int(t) for t in ids]
        best, best_len = None, -1
        for i, call in enumerate(self.calls):
            n = len(call.prompt_ids) + len(call.completion_ids)
            if best_len < n <= len(ids) and ids[:n] == call.prompt_ids + call.completion_ids:
                best, best_len = i, n
        return Context(ids, best, None if best is not None or not self.calls else "fork")

    def record(
        self,
        context: Context,
        messages: Sequence[Mapping[str, Any]],
        reply: Mapping[str, Any],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        weight_step: int,
        truncated: bool,
        text: str | None = None,
    ) -> Call:
        """Keep a sampled choice of the call whose prompt was ``context`` (one record per
        choice: the first continues the parent's sample, the others branch)."""
        if len(completion_ids) != len(logprobs):
            raise ValueError(f"{len(completion_ids)} completion ids, {len(logprobs)} logprobs")
        call = Call(
            messages=[canonical_message(m) for m in messages],
            reply=canonical_message(reply),
            prompt_ids=list(context.ids),
            completion_ids=np.asarray(completion_ids, dtype=np.int64).reshape(-1).tolist(),
            logprobs=np.asarray(logprobs, dtype=np.float64).reshape(-1).tolist(),
            weight_step=int(weight_step),
            truncated=bool(truncated),
            text=text,
        )
        index = len(self.calls)
        parent = context.parent
        if parent is not None and self.parts[self.calls[parent].part][-1] == parent:
            call.part = self.calls[parent].part
            self.parts[call.part].append(index)
        else:
            if self.calls:  # the first call of an episode starts its first sample: no split
                self.splits[context.reason or "branch"] += 1
            call.part = len(self.parts)
            self.parts.append([index])
        self.calls.append(call)
        return call

    @property
    def sampled_tokens(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)

    def rollouts(
        self, *, env_name: str, lesson_id: str, problem_id: str, reward: float
    ) -> list[Rollout]:
        """One :class:`Rollout` per sample (``part`` 0, 1, ...), each with the episode's
        ``reward``. Each call's turn reward is its own (:attr:`Call.reward`); what ``reward``
        holds beyond their sum (an agent's score: all of it) goes to the episode's last call.
        Metadata (weight step: :meth:`weight_step` of each part) is the caller's."""
        out = []
        last = len(self.calls) - 1
        rest = reward - sum(call.reward for call in self.calls)
        for p, indices in enumerate(self.parts):
            tip = self.calls[indices[-1]]
            tokens = tip.prompt_ids + tip.completion_ids
            mask = np.zeros(len(tokens), np.bool_)
            logprobs = np.zeros(len(tokens), np.float32)
            starts = []
            for i in indices:
                call = self.calls[i]
                start = len(call.prompt_ids)
                starts.append(start)
                span = slice(start, start + len(call.logprobs))
                mask[span], logprobs[span] = True, call.logprobs
            out.append(
                Rollout(
                    env_name=env_name,
                    lesson_id=lesson_id,
                    problem_id=problem_id,
                    tokens=tokens,
                    loss_mask=mask,
                    logprobs=logprobs,
                    reward=reward,
                    turn_starts=starts,
                    turn_rewards=[
                        self.calls[i].reward + (rest if i == last and rest else 0.0)
                        for i in indices
                    ],
                    part=p,
                    truncated=tip.truncated,
                )
            )
        return out

    def weight_step(self, part: int) -> int:
        """The oldest weight version any call of sample ``part`` was sampled with."""
        return min(self.calls[i].weight_step for i in self.parts[part])
