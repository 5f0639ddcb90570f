"""The ``judge`` reward function: a language model grades each response against a rubric, served
by any OpenAI-compatible endpoint (a vLLM server, an API), or by marinrl's own generation engine
from a local Hugging Face checkpoint (issue 62).

Each episode becomes one chat request: the rubric ``prompt`` with ``{prompt}``, ``{response}``
and ``{answer}`` filled in (``{{`` and ``}}`` for literal braces), after an optional ``system``
message. The judge's reply is searched for ``score_pattern``; its first group, a number on the
scale ``min_score..max_score``, maps to [0, 1]. A reply with no such number, or with one off the
scale, is no grade (``None``: the job drops that episode's problem and counts it, never a 0).

An endpoint (``url``): requests go out ``concurrency`` at a time through the ``openai`` client,
each bounded by ``timeout_s`` and retried ``retries`` times with its exponential backoff
(connection errors, timeouts, 408/409/429 and 5xx answers); one that still fails is no grade.

A local checkpoint (``checkpoint``): the rollout worker loads it once, on the first batch it
grades, with its own tokenizer (its chat template renders the messages), and the ``kv`` engine
answers the whole batch in one call, ``concurrency`` rows decoding at once (continuous
batching); a request longer than ``max_seq_len`` with its reply is no grade. The model's
weights and KV cache are the worker's, beside the policy's: a judge many times the policy's
size belongs behind an endpoint.

Requests alike within a batch (the same response to the same problem) are asked once. Every
judgment is kept in a cache keyed by the whole request (endpoint, or the checkpoint's files'
names, sizes and times; model, messages, sampling settings): an SQLite file (``cache``;
``auto``: ``~/.cache/marinrl/judge.sqlite``, ``""``: none) that a resumed job, or any later run
asking the same, reads instead of paying again. Nothing read from it is unpickled: it holds
the reply text.

The API key is read from the environment variable ``api_key_env`` (never from the config, which
is saved with the run); a local server that needs none gets ``"none"``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from marin_rl_plugins.reward_terms import check_pattern, check_template

from marin_rl_core import FieldValueError, RewardInput, RewardPlugin, hookimpl

logger = logging.getLogger(__name__)

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


@attrs.frozen(kw_only=True)
class JudgeConfig:
    """Args:
    url: the endpoint's API root (``http://127.0.0.1:8000/v1``); this or ``checkpoint``.
    checkpoint: a local Hugging Face checkpoint directory to run on the rollout worker with
        marinrl's ``kv`` engine; this or ``url``.
    model: the model name sent with each request (an endpoint).
    api_key_env: the environment variable holding the API key (empty or unset: ``"none"``).
    prompt: the rubric, with ``{prompt}``, ``{response}`` and ``{answer}``.
    system: a system message before it (empty: none).
    score_pattern: a regular expression whose first group is the score in the judge's reply.
    min_score: the scale's lowest score (maps to 0).
    max_score: the scale's highest score (maps to 1).
    max_tokens: the judge's reply budget.
    temperature: the judge's sampling temperature.
    concurrency: requests in flight at once (a local checkpoint: rows decoding at once).
    timeout_s: one request's limit (each try; an endpoint).
    retries: tries after the first, with exponential backoff (an endpoint).
    cache: the cache file (``auto``: ``~/.cache/marinrl/judge.sqlite``; ``""``: no cache).
    max_seq_len: a local checkpoint's longest request with its reply, in tokens.
    dtype: a local checkpoint's weights and compute: ``float32`` or ``bfloat16``.
    """

    url: str = ""
    checkpoint: str = ""
    model: str = "judge"
    api_key_env: str = "OPENAI_API_KEY"
    prompt: str = attrs.field(default=DEFAULT_PROMPT, validator=check_template)
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
    max_seq_len: int = attrs.field(default=2048, validator=attrs.validators.ge(16))
    dtype: str = attrs.field(
        default="float32", validator=attrs.validators.in_(("float32", "bfloat16"))
    )

    def __attrs_post_init__(self) -> None:
        if not self.max_score > self.min_score:
            raise FieldValueError("max_score", f"must exceed min_score ({self.min_score})")
        if self.url and self.checkpoint:
            raise FieldValueError(
                "checkpoint", "a judge is served by a url or a checkpoint, not both"
            )


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

    def put(self, replies: dict[str, str]) -> None:
        """Keep ``replies`` (key -> reply) in one transaction: a batch's thousands of replies
        are one commit, not one each (each commit waits for the disk)."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO judgments VALUES (?, ?)", list(replies.items())
            )


class Endpoint:
    """Asks an OpenAI-compatible endpoint, ``concurrency`` requests at a time."""

    def __init__(self, config: JudgeConfig):
        import openai

        self.config = config
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._client = openai.OpenAI(
            base_url=config.url,
            api_key=key or "none",
            timeout=config.timeout_s,
            max_retries=config.retries,
        )
        self.origin = config.url.rstrip("/")
        self.requests = 0
        self.last_error = ""

    def complete(self, asked: dict[str, list[dict[str, str]]]) -> dict[str, str | None]:
        """Each request's reply (``None`` where it failed after its retries)."""
        with concurrent.futures.ThreadPoolExecutor(self.config.concurrency) as pool:
            return dict(zip(asked, pool.map(self._ask, asked.values()), strict=True))

    def _ask(self, messages: list[dict[str, str]]) -> str | None:
        try:
            self.requests += 1
            reply = self._client.chat.completions.create(
                model=self.config.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
            )
            return reply.choices[0].message.content or ""
        except Exception as exc:  # noqa: BLE001 - after the client's retries: no grade
            self.last_error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            return None


def checkpoint_fingerprint(path: Path) -> str:
    """What a local judge's cache keys carry for its weights: the checkpoint's path and its
    files' names, sizes and modification times (a checkpoint written again is a new judge)."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    listing = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
    return f"local:{path.resolve()}@{digest}"


class LocalModel:
    """Answers with a local Hugging Face checkpoint on marinrl's ``kv`` engine, loaded on first
    use, every request of a call in one ``generate``."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.path = Path(config.checkpoint).expanduser()
        self.origin = checkpoint_fingerprint(self.path)
        self.requests = 0
        self.last_error = ""
        self._engine: Any = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        import time

        from marin_rl_core import KVCacheEngine, load_hf_checkpoint, load_tokenizer

        start = time.monotonic()
        self.tokenizer = load_tokenizer(str(self.path))
        model = load_hf_checkpoint(self.path, tokenizer=self.tokenizer, dtype=self.config.dtype)
        self._engine = KVCacheEngine(
            model,
            max_seq_len=self.config.max_seq_len,
            eos_id=self.tokenizer.eos_id,
            max_seqs=self.config.concurrency,
            max_stop_tokens=max(4, len(self.tokenizer.stop_ids)),
            compute_dtype=self.config.dtype,
            memory_fraction=0.5,
        )
        logger.info(
            "judge %s loaded in %.1f s (%d rows at once)",
            self.path, time.monotonic() - start, self._engine.max_seqs,
        )  # fmt: skip

    def _prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer.chat_template is not None:
            return self.tokenizer.encode_chat(messages)
        text = "\n\n".join(m["content"] for m in messages)
        return self.tokenizer.encode(text, add_bos=True)

    def complete(self, asked: dict[str, list[dict[str, str]]]) -> dict[str, str | None]:
        from marin_rl_core import GenerationRequest

        with self._lock:  # (one engine: one batch at a time)
            if self._engine is None:
                self._load()
            prompts = {key: self._prompt(messages) for key, messages in asked.items()}
            room = self.config.max_seq_len - self.config.max_tokens
            fits = {key: p for key, p in prompts.items() if len(p) <= room}
            if len(fits) < len(prompts):
                longest = max(len(p) for p in prompts.values())
                self.last_error = (
                    f"a request of {longest} tokens leaves no room for a reply of max_tokens "
                    f"{self.config.max_tokens} in max_seq_len {self.config.max_seq_len}: raise "
                    "the judge's max_seq_len"
                )
            stops = self.tokenizer.stop_ids
            requests = [
                GenerationRequest(
                    prompt=prompt,
                    temperature=self.config.temperature,
                    max_tokens=self.config.max_tokens,
                    stop_tokens=stops,
                    seed=int(key[:8], 16),  # the request's own: the same reply every time
                )
                for key, prompt in fits.items()
            ]
            self.requests += len(requests)
            samples = self._engine.generate(requests) if requests else []
        replies: dict[str, str | None] = dict.fromkeys(asked)
        for key, (sample,) in zip(fits, samples, strict=True):
            tokens = [int(t) for t in sample.tokens if int(t) not in stops]
            replies[key] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return replies


class Judge:
    """A :class:`~marin_rl_core.protocols.RewardFunction`: asks an OpenAI-compatible endpoint
    or a local checkpoint."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self._pattern = re.compile(config.score_pattern)
        self._backend: Endpoint | LocalModel = (
            LocalModel(config) if config.checkpoint else Endpoint(config)
        )
        path = config.cache
        if path == "auto":
            cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            path = str(cache_home / "marinrl" / "judge.sqlite")
        self._cache = JudgmentCache(Path(path).expanduser()) if path else None
        self.last_error = ""

    @property
    def requests(self) -> int:
        """Requests asked of the judge (cache hits not counted)."""
        return self._backend.requests

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
        request = [self._backend.origin, c.model, messages, c.max_tokens, c.temperature]
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()

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

    def replies(self, items: Sequence[RewardInput]) -> list[str | None]:
        """The judge's reply to each item (``None``: it could not answer): from the cache, else
        asked, each distinct request once; replies with a grade are cached."""
        messages = [self._messages(item) for item in items]
        keys = [self._key(m) for m in messages]
        unique = dict(zip(keys, messages, strict=True))  # the same request asked once
        answered: dict[str, str | None] = {}
        if self._cache is not None:
            for key in unique:
                if (cached := self._cache.get(key)) is not None:
                    answered[key] = cached
        asked = {k: m for k, m in unique.items() if k not in answered}
        if asked:
            self._backend.last_error = ""
            fresh = self._backend.complete(asked)
            answered.update(fresh)
            self.last_error = self._backend.last_error or self.last_error
            if self._cache is not None:  # (an unparsable reply is asked again next time)
                graded = {
                    k: r for k, r in fresh.items() if r is not None and self._grade(r) is not None
                }
                if graded:
                    self._cache.put(graded)
        return [answered[k] for k in keys]

    def score(self, items: Sequence[RewardInput]) -> list[float | None]:
        if not items:
            return []
        replies = self.replies(items)
        grades = [None if r is None else self._grade(r) for r in replies]
        unparsable = [
            r for r, g in zip(replies, grades, strict=True) if r is not None and g is None
        ]
        if unparsable:
            self.last_error = f"a reply without a score on the scale: {unparsable[0][:200]!r}"
        return grades


def preflight(config: JudgeConfig) -> list[str]:
    if config.checkpoint:
        path = Path(config.checkpoint).expanduser()
        if not (path / "config.json").is_file():
            return [
                f"config.checkpoint {config.checkpoint!r} is not a Hugging Face checkpoint "
                "directory (no config.json): give the local directory the judge's model is in"
            ]
        return []
    if not config.url:
        return [
            "set config.url, the judge's OpenAI-compatible endpoint (http://HOST:PORT/v1), or "
            "config.checkpoint, a local Hugging Face checkpoint directory"
        ]
    return []


@hookimpl
def marinrl_register_rewards() -> Any:
    yield RewardPlugin(
        name="judge",
        summary="A language model grades each response against a rubric (a url or a checkpoint).",
        config_class=JudgeConfig,
        build=Judge,
        preflight=preflight,
    )
