"""What an env and an agent see: the problems they pose, the sampling settings of a lesson,
scores, actions and steps, and an agent episode's endpoint and command. A leaf module (numpy and
attrs only), re-exported by :mod:`marin_rl_core.types` and :mod:`marin_rl_core`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
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
]


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
class RewardInput:
    """One finished episode, as a reward function (a ``[[reward.terms]]`` plugin) sees it.

    Args:
        problem: the problem posed (its prompt, reference answer and info).
        response: everything after the prompt, decoded: the response of a single-turn episode;
            the policy's actions and the env's observations between them in a multi-turn one.
        response_tokens: how many tokens the policy sampled (observations not counted).
        env_reward: the env's own reward of the episode.
        truncated: the episode ended on a limit rather than a stop token or ``done``.
        lesson_id: the lesson it was sampled for.
        mode: ``"train"`` or ``"eval"``.
    """

    problem: Problem
    response: str
    response_tokens: int
    env_reward: float
    truncated: bool = False
    lesson_id: str = ""
    mode: str = "train"


@attrs.frozen(kw_only=True)
class Action:
    """What the policy did in one turn, as a multi-turn env's ``step`` receives it.

    Args:
        text: the decoded action, stop token removed.
        token_ids: the exact token ids sampled, the stop token included when one was hit.
        truncated: the action hit the turn's ``max_tokens`` (or the sequence its length limit)
            before a stop token.
        turn: 0 for the first action of the episode.
    """

    text: str
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    truncated: bool = False
    turn: int = 0


def _observation(value: Any) -> str | tuple[Mapping[str, str], ...]:
    if isinstance(value, str):
        return value
    return _messages(value)


@attrs.frozen(kw_only=True)
class Step:
    """A multi-turn env's answer to an action.

    Args:
        observation: what the policy sees next: text (appended as tokens after the action,
            encoded without BOS; with a chat template it becomes a user message), or chat
            messages (``{"role": "tool", "content": ...}``), rendered by the model's chat
            template (without one, their contents are appended as text). Ignored when ``done``.
        reward: the reward of this turn's action. The episode reward is the sum over turns.
        done: the episode is over (solved, failed, or out of moves).
        metrics: named numbers reported beside the reward (as :class:`Score` metrics are);
            the last step's metrics are the episode's.
    """

    observation: str | tuple[Mapping[str, str], ...] = attrs.field(
        default="", converter=_observation
    )
    reward: float = attrs.field(default=0.0, converter=float)
    done: bool = False
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_score_metrics)


@attrs.frozen(kw_only=True)
class AgentEndpoint:
    """Where an agent episode's program reaches the policy: an OpenAI-compatible API of its own
    (:class:`~marin_rl_core.protocols.AgentEnv`). Every call made through ``base_url`` or with
    ``api_key`` is this episode's; it is recorded token for token and trained on.

    Args:
        base_url: the episode's API root (``http://127.0.0.1:PORT/e/KEY/v1``): give it to
            ``openai.OpenAI(base_url=...)``.
        api_key: the episode's key (the server also tells episodes apart by it).
        model: the model name to send (any name is accepted).
        temperature: the lesson's sampling temperature: the default of a request that sets none
            (training logprobs assume it; eval lessons use 0).
        max_tokens: the lesson's ``max_tokens``: the default of a request that sets none.
    """

    base_url: str
    api_key: str
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 16

    def environ(self) -> dict[str, str]:
        """The variables an agent subprocess is started with: ``OPENAI_BASE_URL`` and
        ``OPENAI_API_KEY`` (read by the ``openai`` client itself), ``MARINRL_MODEL``,
        ``MARINRL_TEMPERATURE`` and ``MARINRL_MAX_TOKENS``."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "MARINRL_MODEL": self.model,
            "MARINRL_TEMPERATURE": repr(float(self.temperature)),
            "MARINRL_MAX_TOKENS": str(int(self.max_tokens)),
        }


@attrs.frozen(kw_only=True)
class AgentCommand:
    """An agent program run as a subprocess (what ``AgentEnv.run_agent`` returns for one): it
    is started with ``argv`` and the endpoint's variables (:meth:`AgentEndpoint.environ`) added
    to this process's environment and ``env``; its standard output (text) is the episode's
    result, given to the env's ``score``. A non-zero exit fails the episode (its standard
    error's last lines say why); one still running at ``episodes.episode_timeout_s`` is killed.

    Args:
        argv: the program and its arguments (no shell).
        env: more environment variables.
        cwd: its working directory (default: the rollout worker's).
        stdin: text written to its standard input.
    """

    argv: tuple[str, ...] = attrs.field(converter=tuple)
    env: Mapping[str, str] = attrs.field(factory=dict)
    cwd: str | None = None
    stdin: str | None = None
