"""The data that flows through a marinrl job: problems, rollouts, groups, batches, lessons.

A leaf module: it depends on numpy and attrs only, so the CLI can import it without JAX.
Every class is frozen; build a changed copy with ``attrs.evolve``.

Flow: an :class:`~marin_rl_core.protocols.Env` hands out :class:`Problem` s and scores
responses (a float, or a :class:`Score` with metrics beside the reward); the rollout side turns
each (problem, sampled response) into a :class:`Rollout`, attaches :class:`RolloutMetadata`
(the env never sees it), groups the samples of one problem into a :class:`RolloutGroup` and
ships :class:`RolloutBatch` es through rollout storage to the
trainer's replay buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np


def _int_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.int32).reshape(-1)


def _float_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float32).reshape(-1)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How responses are sampled for a lesson (global defaults, overridable per lesson).

    Args:
        temperature: softmax temperature; 0 means greedy.
        max_tokens: the most response tokens generated per sample.
        n_prompts: problems per rollout batch.
        n_generations_per_prompt: samples per problem (the group size RLOO compares within).
        stop_tokens: token ids that end a response (the tokenizer's EOS is always one).
    """

    temperature: float = 1.0
    max_tokens: int = 8
    n_prompts: int = 32
    n_generations_per_prompt: int = 8
    stop_tokens: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("max_tokens", "n_prompts", "n_generations_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _messages(value: Any) -> tuple[Mapping[str, str], ...]:
    messages = tuple(dict(m) for m in value)
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"Problem.messages[{i}] must be a mapping with string 'role' and 'content' keys "
                f"(chat format: {{'role': 'user', 'content': '...'}}), got {m!r}"
            )
    return messages


@attrs.frozen(kw_only=True)
class Problem:
    """One task instance an env poses: the prompt and whatever the env needs to grade it.

    A problem carries a plain ``prompt``, chat ``messages``, or both. With a model whose
    tokenizer has a chat template (a Hugging Face checkpoint's, ``model.use_chat_template =
    true``), the framework renders ``messages`` through it, or a single user message holding
    ``prompt`` when there are no messages, and opens the assistant's turn. Without a chat template
    (the arithmetic tokenizer of the embedded default model) ``prompt`` is encoded as it is, with
    BOS in front; a problem with only ``messages`` is then an env error. Write ``prompt`` for a
    task any model can take; add ``messages`` for a system prompt or few-shot turns.

    Args:
        id: stable identifier, unique within the env (used in logs and dedup).
        prompt: the text given to the policy.
        answer: the reference answer, if the env grades against one.
        info: anything else the env wants back in ``score``.
        messages: chat messages, ``{"role": "system" | "user" | "assistant", "content": str}``.
    """

    id: str
    prompt: str = ""
    answer: str = ""
    info: Mapping[str, Any] = attrs.field(factory=dict)
    messages: tuple[Mapping[str, str], ...] = attrs.field(default=(), converter=_messages)

    def __attrs_post_init__(self) -> None:
        if not self.prompt and not self.messages:
            raise ValueError(f"problem {self.id!r} needs a prompt or chat messages")


RESERVED_SCORE_METRICS = ("reward", "n")
"""Metric names a :class:`Score` may not use: eval logs ``eval/<lesson>/reward`` and ``/n``."""


def _score_metrics(value: Mapping[str, Any]) -> Mapping[str, float]:
    metrics = {str(name): float(v) for name, v in dict(value).items()}
    for name in metrics:
        if not name or name in RESERVED_SCORE_METRICS:
            raise ValueError(
                f"Score metric name {name!r} is not allowed (empty, or one of "
                f"{', '.join(RESERVED_SCORE_METRICS)}, which eval already reports); rename it"
            )
    return metrics


@attrs.frozen
class Score:
    """An env's grade of one response: the reward, and metrics reported beside it.

    ``Env.score`` returns a float or a ``Score``. Each metric (``{"format": 1.0, "correct":
    0.0}``) is averaged over the rollouts of a batch and logged as ``rollout/score/<name>``
    for training batches and ``eval/<lesson>/<name>`` in evaluation; only ``reward`` trains.

    Args:
        reward: the episode reward.
        metrics: named numbers about the response, such as whether it was well formed.
    """

    reward: float = attrs.field(converter=float)
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_score_metrics)


def as_score(value: float | Score) -> Score:
    """What ``Env.score`` returned, as a :class:`Score` (a plain number has no metrics)."""
    return value if isinstance(value, Score) else Score(float(value))


@attrs.frozen(kw_only=True)
class RolloutMetadata:
    """Where and when a rollout was made; attached by the rollout worker, never by the env.

    Args:
        worker_id: which rollout worker produced it.
        timestamp: ``time.time()`` when it was generated.
        weight_step: the trainer step whose weights sampled it.
        worker_index: the rollout worker's index in the job (``None``: not from a job's worker).
        batch_index: that worker's batch counter when it sampled the rollout. With the run's
            seed and the worker index it fixes the problems and sampling keys the batch drew; a
            resumed run goes on from the batch after the last one its checkpoint had received.
    """

    worker_id: str
    timestamp: float
    weight_step: int
    worker_index: int | None = None
    batch_index: int | None = None


@attrs.frozen(kw_only=True, eq=False)
class Rollout:
    """One prompt, one sampled response, its reward and the behaviour policy's logprobs.

    Args:
        env_name: the env plugin that posed the problem.
        lesson_id: the curriculum lesson it was sampled for.
        problem_id: ``Problem.id``.
        prompt_tokens: int32 ``[prompt_len]``.
        response_tokens: int32 ``[response_len]`` (including the stop token if one was hit).
        response_logprobs: float32 ``[response_len]``, logprob of each response token under the
            sampling policy (the behaviour logprobs the importance ratio divides by).
        reward: the episode reward.
        truncated: the response hit ``max_tokens`` without a stop token.
        metadata: set by the rollout worker; ``None`` only before it is attached.
    """

    env_name: str
    lesson_id: str
    problem_id: str
    prompt_tokens: np.ndarray = attrs.field(converter=_int_array)
    response_tokens: np.ndarray = attrs.field(converter=_int_array)
    response_logprobs: np.ndarray = attrs.field(converter=_float_array)
    reward: float = attrs.field(converter=float)
    truncated: bool = False
    metadata: RolloutMetadata | None = None

    def __attrs_post_init__(self) -> None:
        if self.response_logprobs.shape != self.response_tokens.shape:
            raise ValueError(
                f"response_logprobs has {self.response_logprobs.shape[0]} entries but "
                f"response_tokens has {self.response_tokens.shape[0]}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_tokens.shape[0] + self.response_tokens.shape[0])

    def with_metadata(self, metadata: RolloutMetadata) -> Rollout:
        return attrs.evolve(self, metadata=metadata)


@attrs.frozen(kw_only=True)
class RolloutGroup:
    """The samples drawn for one problem; advantages are computed within a group."""

    rollouts: tuple[Rollout, ...] = attrs.field(converter=tuple)

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([r.reward for r in self.rollouts], dtype=np.float32)


@attrs.frozen(kw_only=True)
class RolloutBatch:
    """What one rollout-worker iteration ships to storage: several groups."""

    groups: tuple[RolloutGroup, ...] = attrs.field(converter=tuple)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]


@attrs.frozen(kw_only=True)
class LessonDependency:
    """A lesson unlocks only once ``lesson`` reaches ``reward_threshold`` in eval."""

    lesson: str
    reward_threshold: float = 0.0


@attrs.frozen(kw_only=True)
class LessonConfig:
    """One lesson of a curriculum: an env configuration plus when to train on it.

    Args:
        id: unique lesson id.
        env: the env plugin name; empty means the run's ``env.name``.
        env_config: overrides of that env's config fields for this lesson.
        dependencies: lessons that must reach a reward before this one unlocks.
        start_threshold: eval reward at which an unlocked lesson starts being sampled more.
        stop_threshold: eval reward at which the lesson graduates.
        plateau_window: how many eval points the plateau check looks back over.
        plateau_threshold: a lesson whose eval reward moves less than this over the window
            has plateaued.
        sampling: per-lesson sampling parameters; ``None`` uses the run's defaults.
        eval_sampling: per-lesson eval sampling parameters (a lesson with longer answers needs
            a larger ``max_tokens``); ``None`` uses the run's ``[eval.sampling]``.
    """

    id: str
    env: str = ""
    env_config: Mapping[str, Any] = attrs.field(factory=dict)
    dependencies: tuple[LessonDependency, ...] = attrs.field(default=(), converter=tuple)
    start_threshold: float = 0.0
    stop_threshold: float = 1.0
    plateau_window: int = 10
    plateau_threshold: float = 0.01
    sampling: SamplingParams | None = None
    eval_sampling: SamplingParams | None = None


@attrs.frozen(kw_only=True)
class LessonStats:
    """What the rollout side reports to the curriculum about one lesson after a batch or eval.

    Args:
        lesson_id: the lesson.
        mean_reward: the mean reward of its rollouts.
        n_rollouts: how many rollouts were scored.
        step: the trainer step whose weights sampled them.
        metrics: the env's :class:`Score` metrics, each averaged over the rollouts that report
            it (evaluation fills them; empty for an env whose ``score`` returns plain floats).
    """

    lesson_id: str
    mean_reward: float
    n_rollouts: int
    step: int
    metrics: Mapping[str, float] = attrs.field(factory=dict)
