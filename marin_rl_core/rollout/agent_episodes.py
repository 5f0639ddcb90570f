"""Agent episodes: an :class:`~marin_rl_core.protocols.AgentEnv`'s batch, each episode a program
talking to the policy through the worker's agent endpoint
(:mod:`~marin_rl_core.rollout.agent_server`).

For each episode of the batch the runner opens a session on the endpoint (a base URL and key of
its own), runs ``env.run_agent(problem, endpoint)`` (a plain function on a thread, an ``async``
one on the runner's loop, or the subprocess an :class:`~marin_rl_core.types.AgentCommand`
describes), scores the result (``env.score(problem, result)``, or the result itself), closes the
session and builds the episode's training samples from its transcript
(:mod:`~marin_rl_core.rollout.transcript`).

* An agent that raises, exits non-zero, or is still running at ``episodes.episode_timeout_s``
  fails its episode (a thread stuck in a sync agent is left behind, a subprocess is killed) and
  nothing else; its later calls are refused. ``run_agent`` and ``score`` are bounded as every env
  call is (:mod:`~marin_rl_core.rollout.env_calls`; ``score`` by ``episodes.step_timeout_s``).
* An episode that ran into a limit (``episodes.max_turns`` calls, ``episodes.max_episode_tokens``,
  ``model.max_seq_len``) ends truncated and is trained on: scored from its result when the agent
  still returned one, with reward 0 when it gave up with an error.
* An episode that made no call has nothing to train on and adds no sample.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import attrs

from marin_rl_core.config.schema import EpisodesConfig
from marin_rl_core.models.tokenizer import response_stop_ids
from marin_rl_core.rollout.agent_api import template_messages
from marin_rl_core.rollout.agent_server import AgentServer, AgentSession
from marin_rl_core.rollout.env_calls import EnvCalls
from marin_rl_core.rollout.episode_state import EpisodeFailure, EpisodeResult
from marin_rl_core.rollout.transcript import Transcript
from marin_rl_core.types import AgentCommand, AgentEndpoint, Problem, SamplingParams, as_score

logger = logging.getLogger(__name__)

STDERR_LINES = 10
"""Lines of a failed agent subprocess's standard error that its failure message quotes."""


KILL_WAIT_S = 10.0
"""How long the exit of a killed agent subprocess (and the closing of its output pipes) is waited
for before the runner stops watching it."""


async def _kill(process: asyncio.subprocess.Process) -> None:
    """Kill an agent subprocess's process group (the program and its children) and wait, for at
    most :data:`KILL_WAIT_S`, until it has exited and its pipes are closed."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        await asyncio.wait_for(process.wait(), KILL_WAIT_S)
    except TimeoutError:
        # A process outside the group (one that left it with setsid) holds the pipes open.
        logger.warning(
            "agent process %d was killed, but its output pipes were still open %.0f s later "
            "(a process it started left its process group); no longer waiting for them",
            process.pid,
            KILL_WAIT_S,
        )
        transport = getattr(process, "_transport", None)
        if transport is not None:
            transport.close()


async def _start(command: AgentCommand, endpoint: AgentEndpoint) -> asyncio.subprocess.Process:
    """Start an agent subprocess in a process group of its own.

    A cancel that lands while it starts (asyncio connects its pipes after the fork) waits until
    the process exists, kills its group and goes on. Left to asyncio, such a cancel kills only the
    program and then waits for its pipes to close, which a child of the program holds open until
    that child ends on its own (minutes for an agent's tool; the batch's cancel waited as long)."""
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *command.argv,
            env={**os.environ, **endpoint.environ(), **dict(command.env)},
            cwd=command.cwd,
            stdin=asyncio.subprocess.PIPE
            if command.stdin is not None
            else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill reaches its children too
        )
    )
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        try:
            process = await starting
        except Exception:  # noqa: BLE001 - it failed to start: nothing to kill
            raise asyncio.CancelledError from None
        await _kill(process)
        raise


async def _run_command(
    command: AgentCommand, endpoint: AgentEndpoint, timeout: float | None
) -> str:
    """Run an agent subprocess to its end; its standard output."""
    process = await _start(command, endpoint)
    data = None if command.stdin is None else command.stdin.encode("utf-8")
    try:
        out, err = await asyncio.wait_for(process.communicate(data), timeout)
    except BaseException:  # a timeout or a cancelled batch: nothing of it may outlive the episode
        await _kill(process)
        raise
    if process.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-STDERR_LINES:]
        raise EpisodeFailure(
            "error",
            f"agent command {command.argv[0]!r} exited with status {process.returncode}"
            + (": " + " | ".join(tail) if tail else " (nothing on standard error)"),
        )
    return out.decode("utf-8", "replace")


class AgentEpisodes:
    """Runs the agent episodes of a rollout worker's batches (one at a time); see the module
    docstring. ``server``: the worker's endpoint."""

    def __init__(self, server: AgentServer):
        self.server = server
        self.tokenizer = server.tokenizer
        self._calls = EnvCalls("marinrl-agents")  # a thread per agent of the batch

    @classmethod
    def start(cls, runner: Any, limits: EpisodesConfig) -> AgentEpisodes:
        """The endpoint of an :class:`~marin_rl_core.rollout.episodes.EpisodeRunner`, listening
        on ``limits.agent_host`` / ``agent_port``: it samples through the runner's generation
        queue, beside the runner's own episodes."""
        server = AgentServer(
            submit=runner.generation.submit,
            tokenizer=runner.tokenizer,
            max_seq_len=runner.max_seq_len,
            host=limits.agent_host,
            port=limits.agent_port,
            batch_window_s=limits.agent_batch_window_s,
            cohorts=limits.generation_cohorts,
        ).start()
        return cls(server)

    @property
    def hung_threads(self) -> int:
        return self._calls.hung_threads

    def close(self) -> None:
        self._calls.close()

    def _render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return self.tokenizer.encode_chat(template_messages(messages), tools=tools)

    async def _episode(
        self,
        env: Any,
        problem: Problem,
        session: AgentSession,
        endpoint: AgentEndpoint,
        limits: EpisodesConfig,
    ) -> tuple[Any, float]:
        """Run the agent and score it; returns its score and the seconds it took."""
        start = time.monotonic()

        def left() -> float | None:
            if session.deadline == float("inf"):
                return None
            remaining = session.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        result = await self._calls.call(
            env.run_agent, problem, endpoint, timeout=None, deadline=session.deadline
        )
        if isinstance(result, AgentCommand):
            result = await _run_command(result, endpoint, left())
        spent = time.monotonic() - start
        score = getattr(env, "score", None)
        if score is None:
            return as_score(result), spent
        return as_score(
            await self._calls.call(score, problem, result, timeout=limits.step_timeout_s)
        ), spent

    async def run(
        self,
        env: Any,
        problems: Sequence[Problem],
        *,
        n: int,
        sampling: SamplingParams,
        seed: int,
        limits: EpisodesConfig,
        env_name: str,
        lesson_id: str,
        weight_step: int,
        model_name: str,
    ) -> tuple[list[list[EpisodeResult]], dict[str, float]]:
        """Run ``n`` agent episodes of each problem at once. Returns ``results[i][k]`` (as
        :meth:`~marin_rl_core.rollout.episodes.EpisodeRunner.run_async` does) and timing metrics:
        ``generate_seconds``, ``generate_calls``."""
        server = self.server
        server.model_name = model_name
        count = len(problems) * n
        self._calls.set_threads(count, grow_only=True)
        now = time.monotonic()
        deadline = now + limits.episode_timeout_s if limits.episode_timeout_s else float("inf")
        sessions = [
            server.open(
                Transcript(self._render),
                index=index,
                seed=seed,
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                weight_step=weight_step,
                deadline=deadline,
                max_calls=limits.max_turns,
                max_sampled=limits.max_episode_tokens,
                stop_ids=response_stop_ids(self.tokenizer, sampling.stop_tokens),
            )
            for index in range(count)
        ]
        seconds, calls = server.generate_seconds, server.generate_calls
        started = time.perf_counter()
        results = [EpisodeResult() for _ in range(count)]

        async def one(index: int) -> None:
            problem, session = problems[index // n], sessions[index]
            endpoint = AgentEndpoint(
                base_url=server.base_url(session),
                api_key=session.key,
                model=model_name,
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
            )
            result = results[index]
            failure: EpisodeFailure | None = None
            score = None
            spent = 0.0
            try:
                score, spent = await self._episode(env, problem, session, endpoint, limits)
            except TimeoutError:
                failure = EpisodeFailure(
                    "timeout", f"the agent ran longer than {limits.episode_timeout_s} s"
                )
            except EpisodeFailure as exc:
                failure = exc
            except Exception as exc:  # noqa: BLE001 - fails this episode only
                failure = EpisodeFailure("error", f"{type(exc).__name__}: {exc}")
                failure.__cause__ = exc
            finally:
                server.close(session, "the agent returned" if failure is None else "it failed")
            transcript = session.transcript
            truncated = session.limit is not None
            if failure is not None and truncated and failure.kind == "error":
                failure, score = None, as_score(0.0)  # gave up at a limit: trained on, reward 0
            result.turns = len(transcript.calls)
            result.env_calls = len(transcript.calls)
            result.env_seconds = max(spent - session.wait_seconds, 0.0)
            result.splits = dict(transcript.splits)
            result.weight_steps = session.weight_steps
            if failure is not None:
                result.failure = failure
                return
            assert score is not None
            result.metrics = dict(score.metrics)
            rollouts = transcript.rollouts(
                env_name=env_name,
                lesson_id=lesson_id,
                problem_id=problem.id,
                reward=score.reward,
            )
            result.rollouts = [
                attrs.evolve(r, truncated=True) if truncated else r for r in rollouts
            ]

        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        finally:
            for session in sessions:
                server.close(session, "its batch was cancelled")
        generating = server.generate_seconds - seconds
        timing = {
            "generate_seconds": generating,
            "generate_calls": float(server.generate_calls - calls),
            # The batch's time outside generation calls: the programs, their clients, HTTP.
            "agent_seconds": max(time.perf_counter() - started - generating, 0.0),
        }
        return [[results[i * n + k] for k in range(n)] for i in range(len(problems))], timing


__all__ = ["AgentEpisodes"]
