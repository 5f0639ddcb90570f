"""The agent endpoint: an OpenAI-compatible HTTP server on each rollout worker through which agent
episodes (:class:`~marin_rl_core.protocols.AgentEnv`) reach the policy.

It serves ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models`` (and a
``GET /health``), on loopback unless ``episodes.agent_host`` says otherwise, with aiohttp on a
thread of its own. Each episode gets a key: its base URL is ``/e/{key}/v1`` and its API key is
the same key, so a call is attributed to its episode by either, and the agent's code needs to
know nothing.

* Batching: the calls of all running episodes wait together and are sampled in the worker's
  generation calls (the sampler the worker trains with, on its current weights), a cohort of
  episodes' calls at a time (:mod:`~marin_rl_core.rollout.agent_batching`).
* Recording: each call's prompt ids, sampled ids and log-probabilities go into the episode's
  :class:`~marin_rl_core.rollout.transcript.Transcript`, which builds the next call's
  prompt from them.
* Limits: ``episodes.max_turns`` calls, ``episodes.max_episode_tokens`` sampled tokens, and
  ``model.max_seq_len`` per call; a call past one is refused (400, code ``episode_limit`` or
  ``context_length_exceeded``) and the episode ends truncated. Calls after an episode closed
  get 410, unknown keys 401.

Why not levanter's own server (``levanter.inference.openai``): it owns a second inference engine
and batching loop beside the worker's sampler (two copies of the weights and KV cache), re-applies
the chat template to each request's messages without recording what was sampled, and has no
notion of episodes, tools, streaming, ``n`` with per-call seeds or limits; it also needs FastAPI
and uvicorn. What the endpoint shares with it is the API; the sampling is the worker's.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core.rollout.agent_api import (
    APIError,
    Request,
    make_choice,
    parse_request,
    response_body,
    stream_events,
)
from marin_rl_core.rollout.agent_batching import AgentCall, CallBatcher
from marin_rl_core.rollout.episode_state import episode_seed, span_weight_steps
from marin_rl_core.rollout.transcript import Transcript

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""The longest the server may take to start listening."""

_CLOSED_KEPT = 4096
"""Closed episodes remembered, so that a late call is told its episode ended (410) rather
than that its key is unknown (401)."""


@attrs.define(eq=False)
class AgentSession:
    """One agent episode as the server sees it."""

    key: str
    index: int  # the episode's index in its batch, for its sampling seeds
    seed: int  # the batch's seed
    transcript: Transcript
    temperature: float
    max_tokens: int
    weight_step: int
    deadline: float
    max_calls: int
    max_sampled: int  # 0: no limit
    stop_ids: tuple[int, ...]  # ids that end a response
    calls: int = 0
    sampled: int = 0
    limit: str | None = None  # the limit the episode ran into, if any
    closed: str | None = None
    wait_seconds: float = 0.0  # time its calls waited for generation
    weight_steps: tuple[int, int] | None = None  # (oldest, newest) that sampled its calls
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class AgentServer:
    """The endpoint (see the module docstring).

    Args:
        submit: queues :class:`~marin_rl_core.generation.GenerationRequest` s and returns a
            future of their samples: the rollout worker's
            :class:`~marin_rl_core.rollout.generation_queue.GenerationQueue`.
        tokenizer: renders chat messages, encodes text prompts, decodes samples.
        max_seq_len: the most tokens of one call (prompt + completion).
        model_name: the name ``/v1/models`` lists and responses carry.
        host, port: where to listen (port 0: any free one).
        batch_window_s: how long a call waits for other episodes' calls to batch with.
        cohorts: a generation call goes once this share (1 / cohorts) of the open episodes has a
            call waiting, and takes at most that many calls (``episodes.generation_cohorts``, as
            in-process episodes are cohorted).
    """

    def __init__(
        self,
        *,
        submit: Callable[..., Any],
        tokenizer: Any,
        max_seq_len: int,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        batch_window_s: float = 0.005,
        cohorts: int = 2,
    ):
        self._submit = submit
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.model_name = model_name
        self.host, self.port = host, port
        self._sessions: dict[str, AgentSession] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.batcher = CallBatcher(
            submit, batch_window_s=batch_window_s, cohorts=cohorts, open_episodes=self._open
        )
        """Batches the episodes' calls into generation calls
        (:mod:`~marin_rl_core.rollout.agent_batching`)."""
        self.requests = 0

    def _open(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def generate_seconds(self) -> float:
        """Seconds spent in generation calls for the agents' calls."""
        return self.batcher.generate_seconds

    @property
    def generate_calls(self) -> int:
        return self.batcher.generate_calls

    @property
    def largest_call(self) -> int:
        """The most agent calls one generation call served."""
        return self.batcher.largest_call

    # --- life -------------------------------------------------------------------------------

    def start(self) -> AgentServer:
        """Listen (on a thread of its own); returns once the port is bound.

        Raises:
            OSError: the address cannot be bound (the message names it).
        """
        from aiohttp import web

        ready = threading.Event()
        failed: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def main() -> None:
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
            try:
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, self.host, self.port)
                loop.run_until_complete(site.start())
                server = site._server  # noqa: SLF001 - the bound port of port 0
                self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
                self.batcher.wake = asyncio.Event()
                batcher = loop.create_task(self.batcher.run())
            except BaseException as exc:  # noqa: BLE001 - raised in start()
                failed.append(exc)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                batcher.cancel()
                loop.run_until_complete(runner.cleanup())
                loop.close()

        self._thread = threading.Thread(target=main, name="marinrl-agent-server", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise OSError(f"the agent endpoint did not start within {START_TIMEOUT_S:.0f} s")
        if failed:
            raise OSError(
                f"the agent endpoint cannot listen on {self.host}:{self.port} ({failed[0]}); set "
                "episodes.agent_port to a free port (0 picks one) or episodes.agent_host"
            ) from failed[0]
        logger.info("agent endpoint listening on http://%s:%d/v1", self.host, self.port)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- episodes ---------------------------------------------------------------------------

    def open(
        self,
        transcript: Transcript,
        *,
        index: int,
        seed: int,
        temperature: float,
        max_tokens: int,
        weight_step: int,
        deadline: float,
        max_calls: int,
        max_sampled: int,
        stop_ids: Sequence[int],
    ) -> AgentSession:
        """Register an episode; its calls are accepted until :meth:`close`. ``stop_ids``: the
        ids that end its responses (:func:`~marin_rl_core.models.tokenizer.response_stop_ids`)."""
        session = AgentSession(
            key=secrets.token_hex(12),
            index=index,
            seed=seed,
            transcript=transcript,
            temperature=temperature,
            max_tokens=max_tokens,
            weight_step=weight_step,
            deadline=deadline,
            max_calls=max_calls,
            max_sampled=max_sampled,
            stop_ids=tuple(int(t) for t in stop_ids),
        )
        with self._lock:
            self._sessions[session.key] = session
        return session

    def close(self, session: AgentSession, reason: str) -> None:
        """End an episode: its later calls are refused (410), and a call being sampled is not
        recorded."""
        with session.lock:
            if session.closed is not None:
                return
            session.closed = reason
        with self._lock:
            self._sessions.pop(session.key, None)
            self._closed[session.key] = reason
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
        loop, wake = self._loop, self.batcher.wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)  # the others may all be waiting now
            except RuntimeError:
                pass

    def base_url(self, session: AgentSession) -> str:
        return f"{self.url}/e/{session.key}/v1"

    # --- HTTP ---------------------------------------------------------------------------------

    def _app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/e/{key}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completion)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "episodes": len(self._sessions)})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "marinrl"}
        return web.json_response({"object": "list", "data": [model]})

    def _session(self, request: Any) -> AgentSession:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        with self._lock:
            session = self._sessions.get(key)
            reason = self._closed.get(key)
        if session is not None:
            return session
        if reason is not None:
            raise APIError(
                410,
                f"this episode has ended ({reason}); its calls are no longer accepted",
                code="episode_closed",
                type="episode_closed",
            )
        raise APIError(
            401,
            "unknown episode key: each agent episode gets its own base URL (/e/KEY/v1) and API "
            "key from marinrl; use the ones it was started with",
            code="invalid_api_key",
            type="authentication_error",
        )

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, "chat")

    async def _completion(self, request: Any) -> Any:
        return await self._serve(request, "completion")

    async def _serve(self, request: Any, kind: str) -> Any:
        from aiohttp import web

        self.requests += 1
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the request body is not JSON: {exc}") from None
            parsed = parse_request(
                kind,
                body,
                default_temperature=session.temperature,
                default_max_tokens=session.max_tokens,
            )
            response = await self._respond(session, parsed)
        except APIError as error:
            return web.json_response(error.body(), status=error.status)
        except ConnectionError:  # the agent hung up mid-request (its episode was cancelled)
            logger.debug("agent endpoint: a %s request's client disconnected", kind)
            return web.Response(status=400, text="client disconnected")  # nobody reads it
        except Exception as exc:  # noqa: BLE001 - the agent sees it; the log keeps the traceback
            logger.exception("agent endpoint: a %s request failed", kind)
            error = APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")
            return web.json_response(error.body(), status=500)
        if not parsed.stream:
            return web.json_response(response, dumps=lambda x: json.dumps(x, ensure_ascii=False))
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        for event in stream_events(parsed, response):
            await stream.write(event.encode("utf-8"))
        await stream.write_eof()
        return stream

    # --- one call -----------------------------------------------------------------------------

    def _context(self, session: AgentSession, request: Request) -> tuple[Any, str | None]:
        transcript = session.transcript
        if request.kind == "chat":
            if self.tokenizer.chat_template is None:
                raise APIError(
                    400,
                    "this model's tokenizer has no chat template: use /v1/completions",
                    param="messages",
                )
            return transcript.context(request.messages or [], request.tools), None
        if isinstance(request.prompt, list):
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in request.prompt):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
            return transcript.context_ids(request.prompt), None
        text = str(request.prompt)
        return transcript.context_text(
            text, lambda s, bos: self.tokenizer.encode(s, add_bos=bos)
        ), text

    def _check_limits(self, session: AgentSession, prompt_len: int) -> int:
        """The call's largest completion, or an error when the episode may not make it."""
        if session.closed is not None:
            raise APIError(410, f"this episode has ended ({session.closed})", code="episode_closed")
        if time.monotonic() > session.deadline:
            raise APIError(
                410,
                "this episode is out of time (episodes.episode_timeout_s)",
                code="episode_closed",
            )
        limit = None
        if session.calls >= session.max_calls:
            limit = f"{session.max_calls} calls (episodes.max_turns)"
        elif session.max_sampled and session.sampled >= session.max_sampled:
            limit = f"{session.max_sampled} sampled tokens (episodes.max_episode_tokens)"
        if limit is not None:
            session.limit = session.limit or limit
            raise APIError(
                400, f"this episode has used its {limit}; it ends truncated", code="episode_limit"
            )
        if prompt_len >= self.max_seq_len:
            session.limit = session.limit or "model.max_seq_len"
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; a call holds at most model.max_seq_len = "
                f"{self.max_seq_len} tokens, completion included",
                param="messages",
                code="context_length_exceeded",
            )
        # The sampler itself keeps each completion within model.max_seq_len: only the episode's
        # own token budget lowers the call's (calls with equal budgets share a generation call).
        room = 1 << 30
        if session.max_sampled:
            room = session.max_sampled - session.sampled
        return room

    def _seeds(self, session: AgentSession, request: Request, call: int) -> list[int]:
        """Each choice's sampling seed: from the request's ``seed``, else from the batch's seed,
        the episode and the call, the first choice's exactly as the in-process episodes' turn
        seeds (:func:`~marin_rl_core.rollout.episode_state.episode_seed`): an agent that plays a
        multi-turn env's game samples what that env's episodes sample."""
        if request.seed is not None:
            base = [request.seed % 2**32]
        else:
            base = [session.seed % 2**32, session.index, call]
        return [
            episode_seed(session.seed, session.index, call)
            if request.seed is None and k == 0
            else int(np.random.SeedSequence([*base, k]).generate_state(1)[0] >> 1)
            for k in range(request.n)
        ]

    async def _respond(self, session: AgentSession, request: Request) -> dict[str, Any]:
        context, text = self._context(session, request)
        with session.lock:
            room = self._check_limits(session, len(context.ids))
            call = session.calls
            session.calls += 1
        budget = min(request.max_tokens, room)
        job = AgentCall(
            episode=session.key,
            prompt=list(context.ids),
            seeds=self._seeds(session, request, call),
            settings=(float(request.temperature), int(budget), session.stop_ids),
            future=asyncio.get_running_loop().create_future(),
        )
        started = time.perf_counter()
        self.batcher.add(job)
        samples = await job.future
        session.wait_seconds += time.perf_counter() - started
        response_id = f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{secrets.token_hex(8)}"
        choices = [
            make_choice(
                request,
                sample,
                session.stop_ids,
                self.tokenizer.decode,
                call_id=f"call_{response_id[-8:]}_{i}",
            )
            for i, sample in enumerate(samples)
        ]
        with session.lock:
            if session.closed is not None:
                raise APIError(
                    410, f"this episode has ended ({session.closed})", code="episode_closed"
                )
            for sample in samples:
                session.weight_steps = span_weight_steps(session.weight_steps, sample.weight_steps)
            for choice, ids, logprobs in choices:
                session.sampled += len(ids)
                session.transcript.record(
                    context,
                    request.messages or [],
                    {
                        "role": "assistant",
                        "content": choice.content,
                        "tool_calls": choice.tool_calls,
                    },
                    ids,
                    logprobs,
                    weight_step=session.weight_step,
                    truncated=choice.finish_reason == "length",
                    text=None if text is None else text + (choice.content or ""),
                )
        return response_body(
            request,
            response_id=response_id,
            created=int(time.time()),
            model=request.model or self.model_name,
            prompt_ids=list(context.ids),
            choices=[c for c, _, _ in choices],
        )


__all__ = ["AgentServer", "AgentSession"]
