"""The rollout side's computing half: inference, envs, rollout generation and evaluation.

:class:`RolloutManager` owns the sampling engine and the current policy weights, builds and caches
one env per lesson, turns problems into scored :class:`~marin_rl_core.types.Rollout` s, evaluates
lessons and reports stats to the curriculum. Its methods take ``weight_step`` and ``worker_id``
as arguments rather than keeping them as state, so it works on its own: ``marinrl eval`` uses it
to score a checkpoint with no weight transfer, storage or Ray.

An env that raises on one problem (while posing or scoring it) loses that problem's group, not
the batch and not the worker: the error is logged once per lesson and counted in
``env_errors``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core.config.converter import lesson_env_config
from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.protocols import CurriculumPolicy, MultiTurnEnv, is_agent_env
from marin_rl_core.registry import Registry
from marin_rl_core.rollout.episode_state import as_multi_turn
from marin_rl_core.rollout.episodes import EpisodeRunner
from marin_rl_core.rollout.reward_terms import TERM_METRIC_PREFIX, RewardTerms
from marin_rl_core.types import (
    LessonConfig,
    LessonStats,
    Problem,
    RolloutBatch,
    RolloutGroup,
    RolloutMetadata,
    SamplingParams,
)

logger = logging.getLogger(__name__)

SCORE_METRIC_PREFIX = "score/"

WARM_UP_STEP_TIMEOUT_S = 5.0
"""The longest one env call of the sampler's warm-up batch may take (at most
``episodes.step_timeout_s``): a hung env must not hold a rollout worker's set-up."""
"""``sample_batch`` reports the mean of each :class:`~marin_rl_core.types.Score` metric under
this prefix (``score/correct``)."""


def batch_stats(lesson_id: str, batch: RolloutBatch | None, step: int) -> LessonStats:
    """Mean reward of a batch, as the curriculum wants it."""
    rollouts = batch.rollouts if batch is not None else []
    rewards = [r.reward for r in rollouts if r.part == 0]  # one per episode
    return LessonStats(
        lesson_id=lesson_id,
        mean_reward=float(np.mean(rewards)) if rewards else 0.0,
        n_rollouts=len(rewards),
        step=step,
    )


def weights_spanned(metadata: RolloutMetadata, steps: tuple[int, int] | None) -> RolloutMetadata:
    """``metadata`` of a rollout whose tokens the weight steps ``steps`` (``(oldest, newest)``,
    ``None``: the batch's) sampled: ``weight_step`` is the oldest (staleness is counted from it),
    ``last_weight_step`` the newest when it differs."""
    if steps is None or steps == (metadata.weight_step, metadata.weight_step):
        return metadata
    oldest, newest = steps
    return attrs.evolve(
        metadata, weight_step=oldest, last_weight_step=newest if newest != oldest else None
    )


class RolloutManager:
    """Inference + envs + curriculum bookkeeping for one process.

    Args:
        config: the run config (lessons, sampling defaults, eval sampling, model sequence length).
        registry: the loaded plugins, to build each lesson's env.
        model: the initial policy (a levanter LM).
        tokenizer: turns prompts into tokens and responses back into text.
        curriculum: receives eval and training stats; ``None`` for pure evaluation.
    """

    def __init__(
        self,
        config: RLJobConfig,
        registry: Registry,
        *,
        model: Any,
        tokenizer: Any,
        curriculum: CurriculumPolicy | None = None,
    ):
        from marin_rl_core.models.tokenizer import response_stop_ids
        from marin_rl_core.rollout.samplers import engine_spec

        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.curriculum = curriculum
        self.lessons: dict[str, LessonConfig] = {
            lesson.id: lesson for lesson in config.curriculum.lessons
        }
        self._envs: dict[str, MultiTurnEnv] = {}
        self.reward_terms = RewardTerms(config, registry, tokenizer)
        """The run's ``[[reward.terms]]`` (none: the env's reward is the reward)."""
        self._errors_logged: set[str] = set()
        self.last_env_error: str | None = None  # the latest env failure, for the watchdog
        self._too_long_logged: set[str] = set()
        self.last_episodes: tuple[list[Problem], list[list[Any]]] = ([], [])
        biggest = max(
            [
                config.sampling_for(lesson).n_prompts
                * config.sampling_for(lesson).n_generations_per_prompt
                for lesson in self.lessons.values()
            ]
            + [
                config.eval.n_examples * config.eval_sampling_for(lesson).n_generations_per_prompt
                for lesson in self.lessons.values()
            ]
        )
        stops = {
            len(response_stop_ids(tokenizer, sampling.stop_tokens))
            for lesson in self.lessons.values()
            for sampling in (config.sampling_for(lesson), config.eval_sampling_for(lesson))
        }
        spec = engine_spec(
            model,
            max_seq_len=config.model.max_seq_len,
            eos_id=tokenizer.eos_id,
            max_seqs=min(biggest, 512),
            max_stop_tokens=max(stops),
            compute_dtype=config.model.resolved_inference_dtype,
            tensor_parallel=config.model.inference_tensor_parallel,
            tensor_parallel_axes=config.trainer.mesh.tensor_parallel_axes,
            memory_fraction=config.model.inference_memory_fraction,
        )
        self._engine = registry.build_engine(config.engine.name, spec, config.engine.config)
        self.engine_name: str = getattr(self._engine, "name", config.engine.name)
        """The engine sampling (the one ``auto`` picked, for ``auto``)."""
        logger.info("sampling with the %s engine", self.engine_name)
        checkpoint = config.model.checkpoint
        self.model_name = str(checkpoint).rstrip("/").rsplit("/", 1)[-1] if checkpoint else "policy"
        """The name the agent endpoint gives the policy (the checkpoint's, else ``policy``)."""
        self._runner = EpisodeRunner(
            self._engine,
            tokenizer,
            use_chat_template=config.model.use_chat_template,
            max_seq_len=config.model.max_seq_len,
        )

    # --- model --------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        return self._engine.model

    @property
    def engine(self) -> Any:
        """The :class:`~marin_rl_core.protocols.GenerationEngine` sampling."""
        return self._engine

    @property
    def in_flight_weights(self) -> bool:
        """Whether the engine takes new weights while rows decode (see
        :meth:`update_model`)."""
        return bool(getattr(self._engine, "in_flight_weights", False))

    def update_model(self, model: Any, *, weight_step: int | None = None) -> None:
        """Sample from ``model`` (new weights, same architecture; the trainer's step
        ``weight_step``) from now on. An engine with ``in_flight_weights`` may be given them
        from another thread while it samples: rows in flight go on with them, and each rollout's
        metadata says the weight steps it spans."""
        if self.in_flight_weights:
            self._engine.update_model(model, weight_step=weight_step)
        else:
            self._engine.update_model(model)

    def shutdown(self) -> None:
        for env in self._envs.values():
            stop = getattr(env, "shutdown", None)
            if stop is not None:
                stop()
        self._envs.clear()
        self._runner.close()

    def cancel(self) -> None:
        """Cancel the batch being sampled, if any (thread-safe): it raises
        :class:`~marin_rl_core.rollout.episode_state.BatchCancelled` at once rather than waiting for its
        episodes (a hung env call's timeout among them)."""
        self._runner.cancel()

    # --- envs ---------------------------------------------------------------------------------

    def env(self, lesson_id: str) -> MultiTurnEnv:
        """The lesson's env, built on first use and cached; a single-turn env comes wrapped
        as a one-step multi-turn env (:func:`~marin_rl_core.rollout.episode_state.as_multi_turn`)."""
        if lesson_id not in self._envs:
            lesson = self.lessons[lesson_id]
            name, env_config = lesson_env_config(self.config, lesson, self.registry)
            build = self.registry.get("env", name).build
            processes = self.config.episodes.env_processes
            if processes:
                from marin_rl_core.rollout.env_pool import EnvProcessPool

                # An agent env's pool is an agent env: its programs run in the processes.
                self._envs[lesson_id] = EnvProcessPool(
                    build, env_config, processes, name=f"{name} ({lesson_id})"
                )
            else:
                self._envs[lesson_id] = as_multi_turn(build(env_config))
                if is_agent_env(self._envs[lesson_id]):
                    logger.info(
                        "lesson %s: %s's agent programs run in this rollout worker's process, "
                        "where their clients' Python shares one interpreter with the sampler; "
                        "episodes.env_processes = N runs them in N processes of their own "
                        "(docs/agents.md#agents-in-processes-of-their-own)",
                        lesson_id,
                        name,
                    )
        return self._envs[lesson_id]

    def _env_error(self, lesson_id: str, what: str, exc: Exception, *, quiet: bool = False) -> None:
        # An episode's failure carries the env's own exception as its cause: its traceback
        # (with the env's file and line) is what the log needs.
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        if quiet:  # the warm-up's: the real batches meet it again and say so
            logger.debug("warm-up: lesson %s: %s: %s: %s", lesson_id, what, type(exc).__name__, exc)
            return
        self.last_env_error = f"lesson {lesson_id}, {what}: {type(exc).__name__}: {exc}"
        if lesson_id not in self._errors_logged:
            self._errors_logged.add(lesson_id)
            logger.warning(
                "lesson %s: the env raised while %s (%s: %s); that problem is dropped "
                "(further errors of this lesson are only counted in env_errors)",
                lesson_id,
                what,
                type(exc).__name__,
                exc,
                exc_info=cause if cause.__traceback__ is not None else None,
            )

    # --- sampling -----------------------------------------------------------------------------

    def sample_batch(
        self,
        lesson_id: str,
        *,
        n_examples: int,
        n_generations: int,
        mode: str,
        seed: int,
        weight_step: int,
        worker_id: str,
        sampling: SamplingParams | None = None,
        worker_index: int | None = None,
        batch_index: int | None = None,
        warm_up: bool = False,
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Pose ``n_examples`` problems and run ``n_generations`` episodes of each (one turn for
        a single-turn env: sample a response, score it); see :mod:`marin_rl_core.rollout.episodes`.
        ``worker_index`` and ``batch_index`` go into every rollout's metadata.

        Returns the batch (``None`` when no problem survived) with :class:`RolloutMetadata`
        attached to every rollout, and metrics: ``reward`` (mean episode reward), ``env_errors``
        (problems whose episodes raised), ``env_timeouts`` (episodes cut off by a timeout),
        ``env_hung_threads`` (threads stuck in env calls that were cut off and have not returned),
        ``prompts_too_long`` (problems dropped because their prompt does not fit
        ``model.max_seq_len``), ``frac_truncated``, ``turns`` (mean actions per episode),
        ``tokens``, ``generated_tokens``, ``seconds`` (in generation calls), ``score_seconds``
        (in env calls, summed over episodes; for an agent env, the batch's wall seconds outside
        generation calls: its programs run concurrently), ``env_step_seconds`` (mean per env call),
        ``tokens_per_second``, and
        ``score/<name>`` for each metric of the env's :class:`~marin_rl_core.types.Score` s,
        averaged over the rollouts that report it; ``reward/<term>`` and ``reward_failures``
        with ``[[reward.terms]]`` (:mod:`~marin_rl_core.rollout.reward_terms`).

        ``warm_up``: a throw-away batch that compiles the sampler: env calls are cut off after
        at most :data:`WARM_UP_STEP_TIMEOUT_S` (a hung env does not hold up the worker's
        set-up), and env errors are not logged (the real batches log them).
        """
        lesson = self.lessons[lesson_id]
        if sampling is None:
            sampling = (
                self.config.eval_sampling_for(lesson)
                if mode == "eval"
                else self.config.sampling_for(lesson)
            )
        env = self.env(lesson_id)
        env_name = lesson.env or self.config.env.name
        limits = self.config.episodes
        if warm_up:
            bound = min(limits.step_timeout_s or WARM_UP_STEP_TIMEOUT_S, WARM_UP_STEP_TIMEOUT_S)
            limits = attrs.evolve(limits, step_timeout_s=bound)
        env_errors = too_long = 0
        try:
            problems = env.sample_problems(n_examples, mode=mode, seed=seed)  # type: ignore[arg-type]
        except Exception as exc:
            self._env_error(lesson_id, "posing problems", exc, quiet=warm_up)
            return None, {"env_errors": float(n_examples)}
        from marin_rl_core.models.tokenizer import encode_prompt

        prompts: list[list[int]] = []
        kept: list[Problem] = []
        limit = self.config.model.max_seq_len - 1
        chat = self.config.model.use_chat_template
        agents = is_agent_env(env)
        for problem in problems if not agents else ():
            try:
                tokens = encode_prompt(self.tokenizer, problem, use_chat_template=chat)
            except Exception as exc:
                self._env_error(lesson_id, f"tokenizing problem {problem.id}", exc, quiet=warm_up)
                env_errors += 1
                continue
            if not 0 < len(tokens) <= limit:
                too_long += 1
                if lesson_id not in self._too_long_logged:  # once per lesson: counted after
                    self._too_long_logged.add(lesson_id)
                    logger.warning(
                        "lesson %s: problem %s's prompt has %d tokens, more than model.max_seq_len"
                        " - 1 = %d; such problems are dropped (counted in "
                        "rollout/prompts_too_long). Raise model.max_seq_len or shorten the prompts",
                        lesson_id,
                        problem.id,
                        len(tokens),
                        limit,
                    )
                continue
            prompts.append(tokens)
            kept.append(problem)
        common = dict(
            n=n_generations,
            sampling=sampling,
            seed=seed,
            limits=limits,
            env_name=env_name,
            lesson_id=lesson_id,
        )
        if agents:  # the agent builds its own prompts: nothing to encode here
            kept = list(problems)
            results, timing = self._runner.run_agents(
                env, kept, weight_step=weight_step, model_name=self.model_name, **common
            )
        elif prompts:
            results, timing = self._runner.run(env, kept, prompts, **common)
        else:
            results, timing = [], {"generate_seconds": 0.0}
        seconds = timing["generate_seconds"]
        metadata = RolloutMetadata(
            worker_id=worker_id,
            timestamp=time.time(),
            weight_step=weight_step,
            worker_index=worker_index,
            batch_index=batch_index,
        )
        done = [] if warm_up else results
        graded = self.reward_terms.grade(kept, done, lesson_id, mode, sampling)
        groups: list[RolloutGroup] = []
        score_metrics: dict[str, list[float]] = {}
        env_seconds = step_seconds = env_calls = timeouts = turns = episodes = splits = 0.0
        for index, (problem, problem_results) in enumerate(zip(kept, results)):
            failures = [r.failure for r in problem_results if r.failure is not None]
            for result in problem_results:
                splits += sum(result.splits.values())
                env_seconds += result.env_seconds
                step_seconds += result.env_step_seconds
                env_calls += result.env_calls
            timeouts += sum(f.kind == "timeout" for f in failures)
            if failures:
                # The group's advantages need every episode: a failed one loses the group.
                worst = next((f for f in failures if f.kind == "error"), failures[0])
                what = f"running problem {problem.id}"
                self._env_error(lesson_id, what, worst, quiet=warm_up)
                env_errors += any(f.kind == "error" for f in failures)
                continue
            if index in graded.failed:  # a reward term could not grade an episode of it
                continue
            rollouts = [
                r.with_metadata(weights_spanned(metadata, result.weight_steps))
                for result in problem_results
                for r in result.rollouts
            ]
            if not rollouts:
                continue
            groups.append(RolloutGroup(rollouts=rollouts))
            for result in problem_results:
                episodes += 1
                turns += result.turns
                for name, value in result.metrics.items():
                    score_metrics.setdefault(name, []).append(value)
        batch = RolloutBatch(groups=groups) if groups else None
        rollouts_all = batch.rollouts if batch else []
        spanning = sum(
            r.metadata is not None and r.metadata.last_weight_step is not None for r in rollouts_all
        )
        generated = sum(r.num_policy_tokens for r in rollouts_all)
        heads = [r for r in rollouts_all if r.part == 0]
        metrics = {
            "env_errors": float(env_errors),
            "prompts_too_long": float(too_long),
            "reward": float(np.mean([r.reward for r in heads])) if heads else 0.0,
            "frac_truncated": float(np.mean([r.truncated for r in heads])) if heads else 0.0,
            "tokens": float(sum(r.num_tokens for r in rollouts_all)),
            "generated_tokens": float(generated),
            "seconds": seconds,
            "score_seconds": timing.get("agent_seconds", env_seconds),
            "tokens_per_second": generated / seconds if seconds > 0 else 0.0,
            "env_timeouts": float(timeouts),
            "turns": turns / episodes if episodes else 0.0,
            "env_step_seconds": step_seconds / env_calls if env_calls else 0.0,
            "env_process_restarts": float(getattr(env, "restarts", 0)),
            "env_hung_threads": float(self._runner.hung_threads),
            # Rollouts sampled by more than one weight step (new weights arrived mid-batch).
            "frac_spanning_weights": spanning / len(rollouts_all) if rollouts_all else 0.0,
            "episode_splits": splits,  # episodes that went on in a new sample (Rollout.part)
        }
        metrics.update(graded.metrics() if self.reward_terms.active else {})
        for name, values in score_metrics.items():
            # A reward term's own metric (rollout/reward/<name>), else the env's Score's.
            prefix = "" if name.startswith(TERM_METRIC_PREFIX) else SCORE_METRIC_PREFIX
            metrics[prefix + name] = float(np.mean(values))
        self.last_episodes = (kept, results)  # each episode's own metrics (`marinrl eval`)
        return batch, metrics

    # --- evaluation ---------------------------------------------------------------------------

    def evaluate_lesson(
        self,
        lesson_id: str,
        *,
        n_examples: int,
        eval_type: str,
        seed: int,
        step: int,
        weight_step: int,
        worker_id: str,
    ) -> tuple[LessonStats, RolloutBatch | None]:
        """Score held-out problems of one lesson with its eval sampling params (the lesson's
        ``eval_sampling``, else the run's ``[eval.sampling]``).

        The stats' ``metrics`` are the means of the env's :class:`~marin_rl_core.types.Score`
        metrics. ``eval_type="eval"`` reports the result to the curriculum (it can unlock or
        graduate lessons) unless no problem was scored (``n_rollouts == 0``: no score at all);
        ``"micro_eval"`` only returns it.
        """
        sampling = self.config.eval_sampling_for(self.lessons[lesson_id])
        batch, metrics = self.sample_batch(
            lesson_id,
            n_examples=n_examples,
            n_generations=sampling.n_generations_per_prompt,
            mode="eval",
            seed=seed,
            weight_step=weight_step,
            worker_id=worker_id,
            sampling=sampling,
        )
        stats = attrs.evolve(
            batch_stats(lesson_id, batch, step),
            metrics={
                name.removeprefix(SCORE_METRIC_PREFIX): value
                for name, value in metrics.items()
                if name.startswith((SCORE_METRIC_PREFIX, TERM_METRIC_PREFIX))
            },
        )
        # An eval in which no problem was scored (all dropped) says nothing about the lesson:
        # reported as reward 0.0 it could un-graduate it.
        if eval_type == "eval" and self.curriculum is not None and stats.n_rollouts:
            self.curriculum.update_eval(stats)
        return stats, batch

    def evaluate_curriculum(
        self,
        *,
        n_examples: int,
        seed: int,
        step: int,
        weight_step: int,
        worker_id: str,
        lesson_ids: Sequence[str] | None = None,
    ) -> dict[str, tuple[LessonStats, RolloutBatch | None]]:
        """Evaluate every lesson (or ``lesson_ids``); each result also goes to the curriculum."""
        return {
            lesson_id: self.evaluate_lesson(
                lesson_id,
                n_examples=n_examples,
                eval_type="eval",
                seed=seed,
                step=step,
                weight_step=weight_step,
                worker_id=worker_id,
            )
            for lesson_id in (lesson_ids or list(self.lessons))
        }

    def update_training_stats(self, lesson_id: str, batch: RolloutBatch | None, step: int) -> None:
        """Report a training batch's rewards to the curriculum."""
        if self.curriculum is not None and batch is not None:
            self.curriculum.update_training(batch_stats(lesson_id, batch, step))
