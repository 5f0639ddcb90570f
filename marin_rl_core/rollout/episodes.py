"""Episodes: the framework's loop over envs, from the first prompt to the last turn's reward.

Every env is run as a :class:`~marin_rl_core.protocols.MultiTurnEnv`: ``reset(problem)`` starts an
episode and ``step(action)`` answers each action with a :class:`~marin_rl_core.types.Step`. A
single-turn :class:`~marin_rl_core.protocols.Env` (``sample_problems`` + ``score``) is wrapped by
:func:`~marin_rl_core.rollout.episode_state.as_multi_turn`: its episode is one step that scores
the action and ends. An episode's state and its token bookkeeping are in
:mod:`~marin_rl_core.rollout.episode_state`; the env threads in :mod:`~marin_rl_core.rollout.env_threads`.

:class:`EpisodeRunner` runs all the episodes of a rollout batch at once:

* A single-turn env's batch is sampled in one call, ``n`` samples per prompt, with the batch's
  seed (exactly the one generation call a batch always was).
* A multi-turn env's episodes are generated in up to ``episodes.generation_cohorts`` batches per
  turn, and env steps run concurrently: an ``async def step`` on the runner's event loop, a plain
  ``reset``/``step`` on a thread of each episode of the batch, or up to ``episodes.env_threads``
  threads when set (calls of different episodes at once; one episode's calls in order; 1
  thread: the env sees one call at a time, as ``score`` always does). A hung call holds up only
  its own episode, and hung calls' timeouts run concurrently. While one cohort's steps run, generation goes on for the episodes waiting for an
  action. Each action's sampling key depends only on the batch seed, the episode and the turn,
  so results do not depend on which episodes happened to be batched together.
* Token in, token out: the tokens the policy sampled are kept as sampled, and an observation
  is appended as its own tokens; earlier tokens are never re-tokenized. Text observations are
  encoded without BOS. With a chat template the conversation so far plus the observation is
  rendered and must *extend* the tokens so far (the extension property); where it does not
  (a template that drops past reasoning, or a sampled action that is not the canonical encoding
  of its text), the episode goes on in a new training sample (``Rollout.part`` 1, 2, ...)
  whose prompt is the fresh rendering.
* Limits: ``episodes.max_turns``, the model's ``max_seq_len`` (the whole episode shares it),
  ``episodes.step_timeout_s`` per env call and ``episodes.episode_timeout_s`` per episode. An
  episode that hits the turn or token limit ends *truncated* and is trained on; an env call that
  exceeds a timeout is cut off (counted in ``env_timeouts``) and an env call that raises fails
  its episode (``env_errors``): a failed episode loses its problem's group, since the group's
  advantages would otherwise be computed without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from marin_rl_core.config.schema import EpisodesConfig
from marin_rl_core.generation import requests_for
from marin_rl_core.models.tokenizer import response_stop_ids
from marin_rl_core.protocols import MultiTurnEnv
from marin_rl_core.rollout.env_calls import EnvCalls
from marin_rl_core.rollout.episode_state import (
    BatchCancelled,
    EpisodeFailure,
    EpisodeResult,
    Live,
    SingleTurnEpisodes,
    episode_rollouts,
    episode_seed,
    observe,
    take_action,
)
from marin_rl_core.rollout.generation_queue import GenerationQueue
from marin_rl_core.types import Action, Problem, SamplingParams, Step, as_score

logger = logging.getLogger(__name__)


# --- the runner ----------------------------------------------------------------------------------


class EpisodeRunner:
    """Runs episodes against a generation engine; see the module docstring.

    Args:
        engine: a :class:`~marin_rl_core.protocols.GenerationEngine` (its ``generate`` is
            called from one thread at a time).
        tokenizer: encodes observations and decodes actions.
        use_chat_template: render chat observations through the tokenizer's chat template.
        max_seq_len: the most tokens of one episode's sample.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        use_chat_template: bool,
        max_seq_len: int,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat = bool(use_chat_template and tokenizer.chat_template is not None)
        self.max_seq_len = max_seq_len
        self._loop = asyncio.new_event_loop()
        self.env_calls = EnvCalls("marinrl-env-steps")
        """Every env call of the runner's episodes, bounded (:mod:`~marin_rl_core.rollout.env_calls`)."""
        self.generation = GenerationQueue(engine)
        """The worker's one generation queue: episodes and agent calls submit here."""
        self._task: asyncio.Task[Any] | None = None  # the batch run() is running
        self._agents: Any = None  # the agent endpoint and its episodes, made on first use

    @property
    def hung_threads(self) -> int:
        """Threads stuck in env calls that were cut off by their timeout and have not returned
        since (a call that was only slow frees its thread when it returns)."""
        agents = self._agents.hung_threads if self._agents is not None else 0
        return self.env_calls.hung_threads + agents

    def close(self) -> None:
        self.env_calls.close()
        self.generation.close()
        if self._agents is not None:
            self._agents.close()
            self._agents.server.stop()
        self._loop.close()

    def run(self, *args: Any, **kwargs: Any) -> tuple[list[list[EpisodeResult]], dict[str, float]]:
        """:meth:`run_async` on the runner's own event loop (kept for the life of the runner,
        so an async env may hold loop-bound resources across batches).

        Raises:
            BatchCancelled: :meth:`cancel` was called while the batch ran.
        """
        return self._run(self.run_async(*args, **kwargs))

    def run_agents(
        self, env: Any, problems: Sequence[Problem], *, limits: EpisodesConfig, **kwargs: Any
    ) -> tuple[list[list[EpisodeResult]], dict[str, float]]:
        """Run an :class:`~marin_rl_core.protocols.AgentEnv`'s episodes through the agent
        endpoint (started on first use): :meth:`AgentEpisodes.run
        <marin_rl_core.rollout.agent_episodes.AgentEpisodes.run>` on the runner's loop."""
        agents = self.agent_episodes(limits)
        return self._run(agents.run(env, problems, limits=limits, **kwargs))

    def agent_episodes(self, limits: EpisodesConfig) -> Any:
        """The runner's agent endpoint and episode runner, started on first use on
        ``limits.agent_host`` / ``agent_port``."""
        if self._agents is None:
            from marin_rl_core.rollout.agent_episodes import AgentEpisodes

            self._agents = AgentEpisodes.start(self, limits)
        return self._agents

    def _run(self, coro: Any) -> Any:
        task = self._loop.create_task(coro)
        self._task = task
        try:
            return self._loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise BatchCancelled("the batch was cancelled: the worker is stopping") from None
        finally:
            self._task = None

    def cancel(self) -> None:
        """Cancel the batch :meth:`run` is running, if any (from any thread): its episodes stop
        waiting for generation and env calls at once (a call already running on an env thread
        is left to finish there), and :meth:`run` raises :class:`BatchCancelled`."""
        task = self._task
        if task is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass

    # --- env calls ------------------------------------------------------------------------

    async def _env_call(
        self,
        live: Live,
        fn: Callable[..., Any],
        *args: Any,
        limits: EpisodesConfig,
        step: bool = True,
    ) -> Any:
        """``fn(*args)`` for ``live``'s episode, bounded by the step timeout and the episode's
        deadline (:meth:`EnvCalls.call <marin_rl_core.rollout.env_calls.EnvCalls.call>`);
        raises :class:`EpisodeFailure`. ``step``: count it as an env step."""

        def spent(seconds: float) -> None:
            live.result.env_seconds += seconds
            if step:
                live.result.env_step_seconds += seconds
                live.result.env_calls += 1

        return await self.env_calls.call(
            fn, *args, timeout=limits.step_timeout_s, deadline=live.deadline, spent=spent
        )

    # --- the loop -------------------------------------------------------------------------

    async def run_async(
        self,
        env: MultiTurnEnv,
        problems: Sequence[Problem],
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        sampling: SamplingParams,
        seed: int,
        limits: EpisodesConfig,
        env_name: str,
        lesson_id: str,
    ) -> tuple[list[list[EpisodeResult]], dict[str, float]]:
        """Run ``n`` episodes of each problem (``prompts[i]`` its prompt tokens), sampling with
        ``sampling``. Every action ends at one of
        :func:`~marin_rl_core.models.tokenizer.response_stop_ids` (EOS, the template's end of turn, the
        checkpoint's and the lesson's stops) or at ``sampling.max_tokens``.

        Returns ``results[i][k]`` for the ``k``-th episode of problem ``i`` and timing metrics:
        ``generate_seconds`` (time in generation calls) and ``generate_calls``.
        """
        stop_tokens = response_stop_ids(self.tokenizer, sampling.stop_tokens)
        stop_set = set(stop_tokens)
        # env_threads = 0: a thread for each episode of the batch (the pool only grows), so
        # that every episode's hung call times out at once.
        self.env_calls.set_threads(
            limits.env_threads or len(problems) * n, grow_only=not limits.env_threads
        )
        now = time.monotonic()
        deadline = now + limits.episode_timeout_s if limits.episode_timeout_s else float("inf")
        lives = [
            Live(
                index=i * n + k,
                problem=problem,
                tokens=[int(t) for t in prompts[i]],
                messages=[dict(m) for m in problem.messages]
                or [{"role": "user", "content": problem.prompt}],
                deadline=deadline,
            )
            for i, problem in enumerate(problems)
            for k in range(n)
        ]
        timing = {"generate_seconds": 0.0, "generate_calls": 0.0}
        ready: list[Live] = []
        wake = asyncio.Event()
        running: set[asyncio.Task[Any]] = set()

        async def generate(batch: list[Live], **kwargs: Any) -> list[list[Any]]:
            start = time.perf_counter()
            requests = requests_for(
                kwargs.pop("prompts"),
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                stop_tokens=stop_tokens,
                **kwargs,
            )
            out = await asyncio.wrap_future(self.generation.submit(requests))
            timing["generate_seconds"] += time.perf_counter() - start
            timing["generate_calls"] += 1
            return out

        def finish(live: Live, failure: EpisodeFailure | None = None) -> None:
            live.result.turns = live.turn
            if failure is not None:
                live.result.failure = failure
                live.result.rollouts = []
            else:
                live.result.rollouts = episode_rollouts(
                    live, env_name=env_name, lesson_id=lesson_id
                )
                live.result.splits = dict(live.transcript.splits)
            close = getattr(env, "close", None)
            if close is not None and live.episode is not None:
                try:
                    close(live.episode)
                except Exception as exc:  # noqa: BLE001 - a failed close loses nothing trained
                    logger.warning(
                        "env %s: close(episode) raised %s: %s", env_name, type(exc).__name__, exc
                    )

        async def act(live: Live, sample: Any) -> None:
            """Apply a sampled action, step the env, and queue the episode for its next one."""
            try:
                action = take_action(live, sample, stop_set, self.tokenizer)
                if live.episode is None and single_turn:
                    live.episode = env.reset(live.problem)  # builds a one-step wrapper: instant
                elif live.episode is None:
                    live.episode = await self._env_call(
                        live, env.reset, live.problem, limits=limits, step=False
                    )
                step = await self._env_call(live, live.episode.step, action, limits=limits)
                if not isinstance(step, Step):
                    raise EpisodeFailure(
                        "error", f"step() returned {type(step).__name__}, expected a Step"
                    )
                live.transcript.calls[-1].reward = float(step.reward)
                live.result.metrics = dict(step.metrics)
                if step.done:
                    finish(live)
                    return
                if live.turn >= limits.max_turns:
                    live.truncated = True
                    finish(live)
                    return
                observe(live, step, tokenizer=self.tokenizer, chat=self.chat)
                if len(live.tokens) >= self.max_seq_len:
                    live.truncated = True  # no room left for another action
                    finish(live)
                    return
                ready.append(live)
                wake.set()
            except EpisodeFailure as failure:
                finish(live, failure)
            except Exception as exc:  # an observation that cannot be encoded, and the like
                finish(live, EpisodeFailure("error", f"{type(exc).__name__}: {exc}"))

        def spawn(coro: Any) -> None:
            task = asyncio.ensure_future(coro)
            running.add(task)
            task.add_done_callback(running.discard)

        single_turn = isinstance(env, SingleTurnEpisodes)
        one_step = getattr(env, "single_turn", False)  # here or in an env process
        cohorts = 1 if one_step else limits.generation_cohorts
        largest = max(1, -(-len(lives) // cohorts))
        if one_step:
            # One call, n per prompt (their prefill shared), the batch's seed: a single-turn
            # env's batch is sampled exactly as one generate call would.
            first = await generate(lives, prompts=list(prompts), n=n, seed=seed) if lives else []
            if single_turn:
                # One step each, all scored in one call on the env thread: no task and no
                # thread round trip per episode.
                await self._score_single_turn(env, lives, first, n, stop_set, limits, finish)
                return (
                    [[lives[i * n + k].result for k in range(n)] for i in range(len(problems))],
                    timing,
                )
            for i in range(len(problems)):
                for k in range(n):
                    spawn(act(lives[i * n + k], first[i][k]))
        else:
            # Multi-turn: generate in cohorts, so that one cohort's env steps overlap the next
            # one's generation; every action's key is the episode's own, so the tokens do not
            # depend on the cohorts (nor on agents calling through the endpoint instead).
            ready.extend(lives)

        # Later turns: whoever waits for an action, batched, with per-episode keys.
        try:
            while running or ready:
                if not ready:
                    wake.clear()
                    waiter = asyncio.ensure_future(wake.wait())
                    try:
                        await asyncio.wait({waiter, *running}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                batch, ready[:] = list(ready[:largest]), ready[largest:]
                expired = [live for live in batch if time.monotonic() > live.deadline]
                for live in expired:
                    finish(live, EpisodeFailure("timeout", "episode timed out"))
                batch = [live for live in batch if live not in expired]
                if not batch:
                    continue
                samples = await generate(
                    batch,
                    prompts=[live.tokens for live in batch],
                    n=1,
                    seed=seed,
                    prompt_seeds=[episode_seed(seed, live.index, live.turn) for live in batch],
                )
                for live, sample in zip(batch, samples):
                    spawn(act(live, sample[0]))
        finally:
            # Cancelled (the worker is stopping): the episodes' tasks stop waiting too.
            for task in list(running):
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return [[lives[i * n + k].result for k in range(n)] for i in range(len(problems))], timing

    async def _score_single_turn(
        self,
        env: SingleTurnEpisodes,
        lives: list[Live],
        samples: list[list[Any]],
        n: int,
        stop_set: set[int],
        limits: EpisodesConfig,
        finish: Callable[..., None],
    ) -> None:
        """Score a single-turn batch: every ``env.score`` call in one job on one env thread, in
        order (:meth:`EnvCalls.call_each
        <marin_rl_core.rollout.env_calls.EnvCalls.call_each>`): each call is still bounded by
        ``step_timeout_s`` and the episode deadline, and fails only its episode."""
        actions: list[Action | None] = []
        for live in lives:
            sample = samples[live.index // n][live.index % n]
            try:
                actions.append(take_action(live, sample, stop_set, self.tokenizer))
            except EpisodeFailure as failure:
                finish(live, failure)
                actions.append(None)
        scored = await self.env_calls.call_each(
            env.env.score,
            [
                None if action is None else (live.problem, action.text)
                for live, action in zip(lives, actions)
            ],
            timeout=limits.step_timeout_s,
            deadlines=[live.deadline for live in lives],
            what="score",
        )
        for j, live in enumerate(lives):
            if actions[j] is None:
                continue
            outcome, spent = scored[j]
            live.result.env_seconds += spent
            live.result.env_step_seconds += spent
            live.result.env_calls += 1
            if isinstance(outcome, EpisodeFailure):
                finish(live, outcome)
                continue
            try:
                score = as_score(outcome)
            except Exception as exc:  # noqa: BLE001 - a score of the wrong type
                finish(live, EpisodeFailure("error", f"{type(exc).__name__}: {exc}"))
                continue
            live.transcript.calls[-1].reward = float(score.reward)
            live.result.metrics = dict(score.metrics)
            finish(live)


__all__ = ["EpisodeRunner", "episode_seed"]
