"""Defaults for a run on a Hugging Face checkpoint (``--model``) where the built-in ones were made
for the tiny default model.

The schema's defaults train the default task: a tiny model learning arithmetic from scratch, two
tokens an answer, 256 rollouts a step, a learning rate of 1e-3. A pretrained chat model needs an
answer budget it can answer in, a learning rate that does not wreck it, and a batch it can take
a step on in reasonable time on the devices at hand. :func:`checkpoint_defaults` sets each of
those the user did not set (in a file, ``--set`` or a resumed run's ``config.toml``) and says so
in one note; anything set explicitly stays as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from marin_rl_core.config.schema import RLJobConfig

CHAT_MAX_TOKENS = 128
"""Response budget of a chat model's samples (a row ends at its stop token before that)."""
CHAT_LEARNING_RATE = 1e-6
"""What RL post-training of pretrained models commonly uses (TRL's GRPO, verl); small models
take more (SmolLM2-135M learns at 5e-6: docs/hf-models.md)."""


def _given(data: Mapping[str, Any], *path: str) -> bool:
    for key in path:
        if not isinstance(data, Mapping) or key not in data:
            return False
        data = data[key]
    return True


def _context(config: RLJobConfig) -> int | None:
    """The checkpoint's context length, or ``None`` where it cannot be read here (a missing
    checkpoint is reported by the checks that follow, with its fix)."""
    from marin_rl_core.models.pretrained import context_length

    try:
        return context_length(config.model)
    except Exception:  # noqa: BLE001 - said by the model checks, not here
        return None


def checkpoint_defaults(
    config: RLJobConfig,
    given: Mapping[str, Any],
    notes: list[str] | None,
    accelerators: tuple[str, int],
) -> RLJobConfig:
    """``config`` with chat-model defaults where the user left the tiny model's (see the module
    docstring). ``accelerators`` is this machine's (``("", 0)`` on CPU only): the batch is 32
    rollouts (4 prompts x 8 samples) on CPU, 128 (16 x 8) with accelerators. The answer budget
    is :data:`CHAT_MAX_TOKENS`, or half a ``model.max_seq_len`` the user set (else half the
    checkpoint's context length) when less."""
    if not config.model.checkpoint:
        return config
    prompts = 16 if accelerators[1] else 4
    answer = CHAT_MAX_TOKENS
    if _given(given, "model", "max_seq_len"):  # a length the user chose: half of it at most
        answer = max(1, min(answer, config.model.max_seq_len // 2))
    elif not (
        _given(given, "sampling", "max_tokens") and _given(given, "eval", "sampling", "max_tokens")
    ):
        # Half the checkpoint's context at most (the rest is for the prompt); read only when
        # a budget is still to be chosen.
        context = _context(config)
        if context:
            answer = max(1, min(answer, context // 2))
    wanted: list[tuple[tuple[str, ...], Any]] = [
        (("sampling", "max_tokens"), answer),
        (("sampling", "temperature"), 1.0),
        (("sampling", "n_prompts"), prompts),
        (("eval", "sampling", "max_tokens"), answer),
        (("trainer", "batch_size"), None),  # a step of one batch of samples (below)
        (("trainer", "learning_rate"), CHAT_LEARNING_RATE),
        (("trainer", "weight_decay"), 0.0),
    ]
    values = {".".join(path): value for path, value in wanted if not _given(given, *path)}
    if not values:
        return config
    sampling = attrs.evolve(
        config.sampling,
        **{k.split(".")[1]: v for k, v in values.items() if k.startswith("sampling.")},
    )
    if "trainer.batch_size" in values:
        values["trainer.batch_size"] = sampling.n_prompts * sampling.n_generations_per_prompt
    evaluating = config.eval.sampling
    if "eval.sampling.max_tokens" in values:
        evaluating = attrs.evolve(evaluating, max_tokens=values["eval.sampling.max_tokens"])
    trainer = attrs.evolve(
        config.trainer,
        **{k.split(".")[1]: v for k, v in values.items() if k.startswith("trainer.")},
    )
    config = attrs.evolve(
        config,
        sampling=sampling,
        eval=attrs.evolve(config.eval, sampling=evaluating),
        trainer=trainer,
    )
    if notes is not None:
        where = "CPU" if not accelerators[1] else f"{accelerators[1]} {accelerators[0]}(s)"
        notes.append(
            "a pretrained model (--model) with the tiny model's defaults left: "
            + ", ".join(f"{k} = {v!r}" for k, v in values.items())  # fmt: skip
            + f" (a batch for this machine's {where}); set any of them to choose another"
        )
    return config
