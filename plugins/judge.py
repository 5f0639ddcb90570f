"""The ``judge`` reward function: a language model grades each response against a rubric, served
by any OpenAI-compatible endpoint (a vLLM server, an API) (issue 62).

Each episode becomes one chat request: the rubric ``prompt`` with ``{prompt}``, ``{response}``
and ``{answer}`` filled in (``{{`` and ``}}`` for literal braces), after an optional ``system``
message. The judge's reply is searched for ``score_pattern``; its first group, a number on the
scale ``min_score..max_score``, maps to [0, 1]. A reply with no such number, or with one off the
scale, is no grade (``None``: the job drops that episode's problem and counts it, never a 0).

Requests go out ``concurrency`` at a time through the ``openai`` client, each bounded by
``timeout_s`` and retried ``retries`` times with its exponential backoff (connection errors,
timeouts, 408/409/429 and 5xx answers); one that still fails is no grade. Requests alike within
a batch (the same response to the same problem) are sent once. Every judgment is kept
in a cache keyed by the whole request (endpoint, model, messages, sampling settings): an SQLite
file (``cache``; ``auto``: ``~/.cache/marinrl/judge.sqlite``, ``""``: none) that a resumed job,
or any later run asking the same, reads instead of paying again. Nothing read from it is
unpickled: it holds the reply text.

The API key is read from the environment variable ``api_key_env`` (never from the config, which
is saved with the run); a local server that needs none gets ``"none"``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import re
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from marin_rl_plugins.reward_terms import check_pattern

from marin_rl_core import FieldValueError, RewardInput, RewardPlugin, hookimpl

DEFAULT_PROMPT = """Grade the response to the problem below on a scale of 0 to 10, 10 being best.

Problem:
{prompt}

Reference answer (may be empty):
{answer}

Response:
{response}

Reply with one line: "Score: N"."""


def _check_pattern(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    check_pattern(instance, attribute, value)  # a regular expression, with a group
    if re.compile(value).groups < 1:
        raise FieldValueError(attribute.name, f"{value!r} needs a group: the score's number")


def _check_prompt(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    try:
        value.format(prompt="", response="", answer="")
    except (KeyError, IndexError, ValueError) as exc:
        raise FieldValueError(
            attribute.name,
            f"fills in only {{prompt}}, {{response}} and {{answer}} (write {{{{ and }}}} for "
            f"braces): {type(exc).__name__}: {exc}",
        ) from None


@attrs.frozen(kw_only=True)
class JudgeConfig:
    """Args:
    url: the endpoint's API root (``http://127.0.0.1:8000/v1``); required.
    model: the model name sent with each request.
    api_key_env: the environment variable holding the API key (empty or unset: ``"none"``).
    prompt: the rubric, with ``{prompt}``, ``{response}`` and ``{answer}``.
    system: a system message before it (empty: none).
    score_pattern: a regular expression whose first group is the score in the judge's reply.
    min_score: the scale's lowest score (maps to 0).
    max_score: the scale's highest score (maps to 1).
    max_tokens: the judge's reply budget.
    temperature: the judge's sampling temperature.
    concurrency: requests in flight at once.
    timeout_s: one request's limit (each try).
    retries: tries after the first, with exponential backoff.
    cache: the cache file (``auto``: ``~/.cache/marinrl/judge.sqlite``; ``""``: no cache).
    """

    url: str = ""
    model: str = "judge"
    api_key_env: str = "OPENAI_API_KEY"
    prompt: str = attrs.field(default=DEFAULT_PROMPT, validator=_check_prompt)
    system: str = ""
    score_pattern: str = attrs.field(
        default=r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)", validator=_check_pattern
    )
    min_score: float = 0.0
    max_score: float = 10.0
    max_tokens: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    temperature: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    concurrency: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    retries: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    cache: str = "auto"

    def __attrs_post_init__(self) -> None:
        if not self.max_score > self.min_score:
            raise FieldValueError("max_score", f"must exceed min_score ({self.min_score})")


class JudgmentCache:
    """Judgments by request digest in an SQLite file (text only; safe to share between the
    processes of one host: SQLite locks it)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS judgments (key TEXT PRIMARY KEY, reply TEXT)"
            )

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT reply FROM judgments WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, key: str, reply: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO judgments VALUES (?, ?)", (key, reply))


class Judge:
    """A :class:`~marin_rl_core.protocols.RewardFunction` asking an OpenAI-compatible endpoint."""

    def __init__(self, config: JudgeConfig):
        import openai

        self.config = config
        self._pattern = re.compile(config.score_pattern)
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._client = openai.OpenAI(
            base_url=config.url,
            api_key=key or "none",
            timeout=config.timeout_s,
            max_retries=config.retries,
        )
        path = config.cache
        if path == "auto":
            cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            path = str(cache_home / "marinrl" / "judge.sqlite")
        self._cache = JudgmentCache(Path(path).expanduser()) if path else None
        self.requests = 0
        """Requests sent (cache hits not counted)."""
        self.last_error = ""

    def _messages(self, item: RewardInput) -> list[dict[str, str]]:
        problem = item.problem
        prompt = problem.prompt or "\n".join(m["content"] for m in problem.messages)
        text = self.config.prompt.format(
            prompt=prompt, response=item.response, answer=problem.answer
        )
        system = [{"role": "system", "content": self.config.system}] if self.config.system else []
        return [*system, {"role": "user", "content": text}]

    def _key(self, messages: list[dict[str, str]]) -> str:
        c = self.config
        request = [c.url.rstrip("/"), c.model, messages, c.max_tokens, c.temperature]
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()

    def _ask(self, key: str, messages: list[dict[str, str]]) -> str | None:
        """The judge's reply to ``messages`` (digest ``key``: :meth:`_key`), from the cache,
        else the endpoint; ``None`` when it failed."""
        if self._cache is not None and (cached := self._cache.get(key)) is not None:
            return cached
        try:
            self.requests += 1
            reply = self._client.chat.completions.create(
                model=self.config.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
            )
            text = reply.choices[0].message.content or ""
        except Exception as exc:  # noqa: BLE001 - after the client's retries: no grade
            self.last_error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            return None
        if self._cache is not None and self._grade(text) is not None:
            self._cache.put(key, text)  # (an unparsable reply is asked again next time)
        return text

    def _grade(self, reply: str) -> float | None:
        match = self._pattern.search(reply)
        if match is None:
            return None
        try:
            score = float(match.group(1))
        except (TypeError, ValueError):
            return None
        low, high = self.config.min_score, self.config.max_score
        if not (math.isfinite(score) and low <= score <= high):
            return None
        return (score - low) / (high - low)

    def score(self, items: Sequence[RewardInput]) -> list[float | None]:
        if not items:
            return []
        messages = [self._messages(item) for item in items]
        keys = [self._key(m) for m in messages]
        unique = dict(zip(keys, messages, strict=True))  # the same request asked once
        with concurrent.futures.ThreadPoolExecutor(self.config.concurrency) as pool:
            answered = dict(zip(unique, pool.map(self._ask, unique, unique.values()), strict=True))
        replies = [answered[k] for k in keys]
        grades = [None if r is None else self._grade(r) for r in replies]
        unparsable = [
            r for r, g in zip(replies, grades, strict=True) if r is not None and g is None
        ]
        if unparsable:
            self.last_error = f"a reply without a score on the scale: {unparsable[0][:200]!r}"
        return grades


def preflight(config: JudgeConfig) -> list[str]:
    if not config.url:
        return ["set config.url, the judge's OpenAI-compatible endpoint (http://HOST:PORT/v1)"]
    return []


@hookimpl
def marinrl_register_rewards() -> Any:
    yield RewardPlugin(
        name="judge",
        summary="A language model grades each response against a rubric (an OpenAI-compatible url).",
        config_class=JudgeConfig,
        build=Judge,
        preflight=preflight,
    )
