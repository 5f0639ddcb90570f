"""The data that flows through a marinrl job: problems, rollouts, groups, batches, lessons.

A leaf module: it depends on numpy and attrs only, so the CLI can import it without JAX.
Every class is frozen; build a changed copy with ``attrs.evolve``.

Flow: an :class:`~marin_rl_core.protocols.Env` hands out :class:`Problem` s and scores
responses (a float, or a :class:`Score` with metrics beside the reward); a
:class:`~marin_rl_core.protocols.MultiTurnEnv` instead answers each :class:`Action` with a
:class:`Step` (observation, reward, done). The rollout side turns each episode into a token-exact
:class:`Rollout`, attaches :class:`RolloutMetadata`
(the env never sees it), groups the samples of one problem into a :class:`RolloutGroup` and
ships :class:`RolloutBatch` es through rollout storage to the
trainer's replay buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from marin_rl_core.env_types import (
    RESERVED_SCORE_METRICS,
    Action,
    AgentCommand,
    AgentEndpoint,
    Problem,
    RewardInput,
    SamplingParams,
    Score,
    Step,
    as_score,
)


def _int_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.int32).reshape(-1)


def _float_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float32).reshape(-1)


@attrs.frozen(kw_only=True)
class RolloutMetadata:
    """Where and when a rollout was made; attached by the rollout worker, never by the env.

    Args:
        worker_id: which rollout worker produced it.
        timestamp: ``time.time()`` when it was generated.
        weight_step: the trainer step whose weights sampled it: the oldest, when new weights
            arrived while it was sampled (``episodes.in_flight_weights``); the replay buffer
            counts its staleness from this one.
        last_weight_step: the newest weight step that sampled any of its tokens, when that is
            not ``weight_step``; ``None``: ``weight_step`` sampled all of it.
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
    last_weight_step: int | None = None


def _bool_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=bool).reshape(-1)


@attrs.frozen(kw_only=True, eq=False)
class Rollout:
    """One training sample of an episode: the exact tokens, which of them the policy sampled,
    its behaviour logprobs, its rewards and where each turn starts.

    An episode is the prompt, then turns: the policy's action (the tokens it sampled, stop token
    included) followed by the env's observation tokens (none after the last turn). ``tokens``
    holds all of them as they were sampled and appended, never re-tokenized. A single-turn
    rollout is ``prompt + response`` (:meth:`single_turn` builds one).

    Args:
        env_name: the env plugin that posed the problem.
        lesson_id: the curriculum lesson it was sampled for.
        problem_id: ``Problem.id``.
        tokens: int32 ``[n]``: prompt, then each turn's action and observation tokens.
        loss_mask: bool ``[n]``, true exactly on the tokens the policy sampled.
        logprobs: float32 ``[n]``, the sampling policy's logprob of each sampled token (the
            behaviour logprobs the importance ratio divides by); 0 where ``loss_mask`` is false.
        reward: the episode reward (the sum of the turn rewards, unless the env says otherwise).
        turn_starts: int32 ``[turns]``, the index in ``tokens`` of each turn's first action token;
            turn ``i`` runs to ``turn_starts[i+1]`` (the last one to the end).
        turn_rewards: float32 ``[turns]``, the reward the env gave for each turn's action.
        token_rewards: float32 ``[n]`` per-token rewards for value-based losses, or empty (then
            :meth:`dense_rewards` puts each turn's reward on its last action token).
        part: 0, or the index of this sample within an episode that was split because a chat
            template would have changed earlier tokens (parts follow part 0 in their group and
            share its advantage).
        truncated: the episode ended on a limit (an action hit ``max_tokens``, the sequence hit
            ``model.max_seq_len``, or the turn limit) rather than by the env.
        reward_terms: with ``[[reward.terms]]``, each term's value before its weight (the
            ``reward`` is their weighted sum); empty otherwise.
        metadata: set by the rollout worker; ``None`` only before it is attached.
    """

    env_name: str
    lesson_id: str
    problem_id: str
    tokens: np.ndarray = attrs.field(converter=_int_array)
    loss_mask: np.ndarray = attrs.field(converter=_bool_array)
    logprobs: np.ndarray = attrs.field(converter=_float_array)
    reward: float = attrs.field(converter=float)
    turn_starts: np.ndarray = attrs.field(converter=_int_array)
    turn_rewards: np.ndarray = attrs.field(converter=_float_array)
    token_rewards: np.ndarray = attrs.field(
        factory=lambda: np.zeros(0, np.float32), converter=_float_array
    )
    part: int = 0
    truncated: bool = False
    reward_terms: Mapping[str, float] = attrs.field(
        factory=dict, converter=lambda v: {str(k): float(x) for k, x in dict(v).items()}
    )
    metadata: RolloutMetadata | None = None

    def __attrs_post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("loss_mask", "logprobs"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"{name} has {getattr(self, name).shape[0]} entries but tokens has {n}"
                )
        if self.token_rewards.shape[0] not in (0, n):
            raise ValueError(
                f"token_rewards has {self.token_rewards.shape[0]} entries; give one per token "
                f"({n}) or none"
            )
        starts = self.turn_starts
        if starts.shape != self.turn_rewards.shape:
            raise ValueError(
                f"{starts.shape[0]} turn_starts but {self.turn_rewards.shape[0]} turn_rewards"
            )
        if starts.size:
            increasing = starts.size == 1 or bool(np.all(starts[1:] > starts[:-1]))
            if starts[0] < 1 or not increasing or starts[-1] >= n:
                raise ValueError(
                    f"turn_starts must increase within 1..{n - 1} (the prompt comes first), "
                    f"got {starts.tolist()}"
                )
            if not self.loss_mask[starts].all():
                raise ValueError("every turn must start with a policy-sampled token")
        if n and self.loss_mask[0]:
            raise ValueError("the first token is the prompt's; it cannot be policy-sampled")

    @classmethod
    def single_turn(
        cls,
        *,
        env_name: str,
        lesson_id: str,
        problem_id: str,
        prompt_tokens: Any,
        response_tokens: Any,
        response_logprobs: Any,
        reward: float,
        truncated: bool = False,
        metadata: RolloutMetadata | None = None,
    ) -> Rollout:
        """A one-turn rollout: ``prompt + response``, the response sampled by the policy."""
        prompt = _int_array(prompt_tokens)
        response = _int_array(response_tokens)
        logprobs = _float_array(response_logprobs)
        if logprobs.shape != response.shape:
            raise ValueError(
                f"response_logprobs has {logprobs.shape[0]} entries but response_tokens has "
                f"{response.shape[0]}"
            )
        p = prompt.shape[0]
        return cls(
            env_name=env_name,
            lesson_id=lesson_id,
            problem_id=problem_id,
            tokens=np.concatenate([prompt, response]),
            loss_mask=np.arange(p + response.shape[0]) >= p,
            logprobs=np.concatenate([np.zeros(p, np.float32), logprobs]),
            reward=reward,
            turn_starts=[p] if response.size else [],
            turn_rewards=[reward] if response.size else [],
            truncated=truncated,
            metadata=metadata,
        )

    @property
    def prompt_length(self) -> int:
        """Tokens before the first policy-sampled one."""
        sampled = np.flatnonzero(self.loss_mask)
        return int(sampled[0]) if sampled.size else int(self.tokens.shape[0])

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> np.ndarray:
        """Everything after the prompt: actions and the observations between them."""
        return self.tokens[self.prompt_length :]

    @property
    def response_logprobs(self) -> np.ndarray:
        """``logprobs`` after the prompt (0 at observation tokens)."""
        return self.logprobs[self.prompt_length :]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_turns(self) -> int:
        return int(self.turn_starts.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        """Tokens the policy sampled (the ones the loss trains on)."""
        return int(np.count_nonzero(self.loss_mask))

    def turn_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each turn in ``tokens``: its action, then its observation."""
        ends = [*self.turn_starts[1:].tolist(), self.num_tokens]
        return list(zip(self.turn_starts.tolist(), ends))

    def dense_rewards(self) -> np.ndarray:
        """float32 ``[n]``: ``token_rewards`` if given, else each turn's reward on the last token
        the policy sampled in that turn."""
        if self.token_rewards.size:
            return self.token_rewards
        out = np.zeros(self.num_tokens, np.float32)
        for (start, end), reward in zip(self.turn_spans(), self.turn_rewards):
            sampled = np.flatnonzero(self.loss_mask[start:end])
            out[start + int(sampled[-1])] = reward
        return out

    def with_metadata(self, metadata: RolloutMetadata) -> Rollout:
        """This rollout with ``metadata`` (a copy: the arrays are shared, not re-validated)."""
        out = copy.copy(self)
        object.__setattr__(out, "metadata", metadata)
        return out


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
class RunInfo:
    """The run a storage plugin is built for (``StoragePlugin.build(config, run)``).

    Args:
        run_id: the run's id (the last part of its run directory): names the run's rollouts
            where several runs share a bucket.
        run_dir: the run directory: an absolute local path or a bucket URL (``gs://...``;
            :mod:`marin_rl_core.rundir`); where a storage keeps rollouts by default.
    """

    run_id: str
    run_dir: str


@attrs.frozen(kw_only=True, eq=False)
class ReceivedWeights:
    """What ``WeightTransferClient.receive`` returns: newer weights and how they came.

    Args:
        model: ``like_model`` with the received weights (each array on ``like_model``'s leaf's
            device/sharding).
        weight_step: the trainer step of these weights.
        nbytes: bytes received.
        seconds: wall-clock seconds the receive took (asking included).
        latest_step: the newest step the server had published when the receive ended (the
            trainer may have published again during the transfer: ``latest_step -
            weight_step`` is the version lag).
    """

    model: Any
    weight_step: int
    nbytes: int
    seconds: float
    latest_step: int

    def metrics(self) -> dict[str, float]:
        """``bytes``, ``seconds``, ``gb_per_s`` and ``lag_steps`` of this receive."""
        return {
            "bytes": float(self.nbytes),
            "seconds": self.seconds,
            "gb_per_s": self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0,
            "lag_steps": float(max(0, self.latest_step - self.weight_step)),
        }


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
    plateau_window: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    plateau_threshold: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))
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


__all__ = [
    # what envs and agents see (marin_rl_core.env_types)
    "RESERVED_SCORE_METRICS",
    "Action",
    "AgentCommand",
    "AgentEndpoint",
    "Problem",
    "RewardInput",
    "SamplingParams",
    "Score",
    "Step",
    "as_score",
    # what flows through a job
    "LessonConfig",
    "LessonDependency",
    "LessonStats",
    "ReceivedWeights",
    "Rollout",
    "RolloutBatch",
    "RolloutGroup",
    "RolloutMetadata",
    "RunInfo",
]
