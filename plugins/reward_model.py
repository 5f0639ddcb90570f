"""The ``reward_model`` reward function: a learned reward model, a Hugging Face
sequence-classification checkpoint with one output (a Llama, Qwen2 or Qwen3 body and a scalar
``score`` head, as TRL's ``RewardTrainer`` saves them), scores each episode (issue 62).

The rollout worker loads the checkpoint once, on the first batch it grades, and scores the
batch ``batch_size`` sequences at a time (:class:`marin_rl_core.RewardModel`, the values
``transformers`` gives). Each episode is rendered the way reward models are trained: the prompt
as the user's turn and the response as the assistant's through the reward model's own chat
template (no generation prompt after it); a tokenizer without a template gets prompt and
response run together. ``prompt`` replaces that with a template of one's own (``{prompt}``,
``{response}``, ``{answer}``). The value is the raw score, or its sigmoid (``sigmoid``: a
Bradley-Terry model's score as a probability in (0, 1)). An episode longer than ``max_seq_len``
tokens is no grade (the job drops its problem and counts it; never a 0).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from marin_rl_plugins.reward_terms import check_template

from marin_rl_core import RewardInput, RewardPlugin, hookimpl


@attrs.frozen(kw_only=True)
class RewardModelConfig:
    """Args:
    checkpoint: the sequence-classification checkpoint directory (required).
    prompt: a template of one's own for the scored text (``{prompt}``, ``{response}``,
        ``{answer}``); empty: the reward model's chat template, user then assistant.
    sigmoid: map the raw score through the sigmoid into (0, 1).
    max_seq_len: the longest episode scored, in the reward model's tokens.
    batch_size: sequences per forward pass.
    dtype: the weights and compute: ``float32`` or ``bfloat16``.
    """

    checkpoint: str = ""
    prompt: str = attrs.field(default="", validator=check_template)
    sigmoid: bool = False
    max_seq_len: int = attrs.field(default=2048, validator=attrs.validators.ge(16))
    batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    dtype: str = attrs.field(
        default="float32", validator=attrs.validators.in_(("float32", "bfloat16"))
    )


class RewardModelTerm:
    """A :class:`~marin_rl_core.protocols.RewardFunction` scoring with a reward model."""

    def __init__(self, config: RewardModelConfig):
        self.config = config
        self.last_error = ""
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        from marin_rl_core import RewardModel

        if self._model is None:
            self._model = RewardModel(
                self.config.checkpoint,
                dtype=self.config.dtype,
                max_seq_len=self.config.max_seq_len,
                batch_size=self.config.batch_size,
            )
        return self._model

    def tokens(self, item: RewardInput) -> list[int]:
        """The reward model's tokens of an episode (see the module docstring)."""
        tokenizer = self._load().tokenizer
        problem = item.problem
        if self.config.prompt:
            text = self.config.prompt.format(
                prompt=problem.prompt or "\n".join(m["content"] for m in problem.messages),
                response=item.response,
                answer=problem.answer,
            )
            return tokenizer.encode(text, add_bos=True)
        turns = [dict(m) for m in problem.messages] or [{"role": "user", "content": problem.prompt}]
        if tokenizer.chat_template is None:
            text = "\n".join(m["content"] for m in turns) + item.response
            return tokenizer.encode(text, add_bos=True)
        text = tokenizer.to_hf().apply_chat_template(
            [*turns, {"role": "assistant", "content": item.response}],
            tokenize=False,
            add_generation_prompt=False,
        )
        return tokenizer.encode(text)  # the template writes its own BOS

    def score(self, items: Sequence[RewardInput]) -> list[float | None]:
        if not items:
            return []
        with self._lock:  # (one model: one batch at a time)
            model = self._load()
            rows = [self.tokens(item) for item in items]
            fits = [i for i, row in enumerate(rows) if 0 < len(row) <= self.config.max_seq_len]
            if len(fits) < len(rows):
                longest = max(len(r) for r in rows)
                self.last_error = (
                    f"an episode of {longest} tokens is longer than max_seq_len "
                    f"{self.config.max_seq_len}: raise the reward model's max_seq_len"
                )
            values = model.score([rows[i] for i in fits])
        out: list[float | None] = [None] * len(items)
        for i, value in zip(fits, values, strict=True):
            out[i] = 0.5 * (1 + math.tanh(value / 2)) if self.config.sigmoid else value
        return out


def preflight(config: RewardModelConfig) -> list[str]:
    from marin_rl_core import ConfigError, RewardModel

    if not config.checkpoint:
        return ["set config.checkpoint, the reward model's sequence-classification checkpoint"]
    if not (Path(config.checkpoint).expanduser() / "config.json").is_file():
        return [
            f"config.checkpoint {config.checkpoint!r} is not a Hugging Face checkpoint directory "
            "(no config.json)"
        ]
    try:
        RewardModel.check(config.checkpoint)
    except ConfigError as exc:
        return [str(exc)]
    return []


@hookimpl
def marinrl_register_rewards() -> Any:
    yield RewardPlugin(
        name="reward_model",
        summary="A learned reward model (a sequence-classification checkpoint) scores each episode.",
        config_class=RewardModelConfig,
        build=RewardModelTerm,
        preflight=preflight,
    )
