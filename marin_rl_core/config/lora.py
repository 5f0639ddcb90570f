"""``[model.lora]``: low-rank adapters instead of full fine-tuning (issue 61; what they do to
training, sampling and checkpoints is :mod:`marin_rl_core.models.lora`'s)."""

from __future__ import annotations

from typing import Any

import attrs

from marin_rl_core.errors import FieldValueError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA adapts by default: every linear layer of attention and the MLP (not the
embeddings or the LM head), as PEFT's ``target_modules="all-linear"`` does for these models."""


def _check_lora_dropout(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise FieldValueError(attribute.name, f"must be in [0, 1), got {value}")


def _check_lora_targets(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    known = (*LORA_TARGETS, "lm_head")
    unknown = [name for name in value if name not in known]
    if unknown or not value:
        raise FieldValueError(
            attribute.name,
            f"{', '.join(map(repr, unknown)) or 'an empty list'} names no linear layer of the "
            f"supported models; choose from {', '.join(known)}",
        )


@attrs.frozen(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the policy's linear layers (``[model.lora]``; issue 61).

    With ``rank > 0`` the trainer trains only the adapters (and a loss's own state, such as
    ppo's critic): the base weights stay frozen, in the compute precision, with no gradients
    or optimizer state of their own. Each adapted layer ``W`` computes ``W x + (alpha / rank)
    B A x`` with ``A`` random and ``B`` zero at the start (PEFT's init), so step 0's policy is
    the base model. Rollout workers apart from the trainer sample from the base with the
    adapters merged in, a colocated one from the trainer's own base with the adapters applied
    (no copy); a loss's KL reference is the base model with the adapters switched off (no
    copy).

    Args:
        rank: the adapters' rank ``r``; 0 (the default): no adapters, full fine-tuning.
        alpha: the adapters' scale is ``alpha / rank``; 0 (the default): twice the rank.
        dropout: dropout on each adapter's input while training (0: none).
        targets: the linear layers to adapt, by the name of their attribute (every attention
            and MLP projection by default); a name no layer of the model has is an error.
    """

    rank: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    alpha: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    dropout: float = attrs.field(default=0.0, validator=_check_lora_dropout)
    targets: tuple[str, ...] = attrs.field(default=LORA_TARGETS, validator=_check_lora_targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on each adapter's output."""
        return (self.alpha or 2.0 * self.rank) / self.rank if self.rank else 0.0
