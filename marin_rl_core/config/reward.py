"""``[reward]``: a reward combined from several terms (issue 62; what the terms do to rollouts is
:mod:`marin_rl_core.rollout.reward_terms`'s).

```toml
[[reward.terms]]
name = "correct"      # the env's own score
fn = "env"
weight = 1.0

[[reward.terms]]
name = "brevity"
fn = "length"         # a reward plugin (kind "reward")
weight = 0.5
config = { free_tokens = 4, per_tokens = 8 }
```
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from marin_rl_core.errors import FieldValueError

RESERVED_TERM_NAMES = ("reward", "n", "total")
"""Names a term may not take: metrics ``eval/<lesson>/reward`` and ``/n`` exist already."""


def _check_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if (
        not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", value or "")
        or value in RESERVED_TERM_NAMES
    ):
        raise FieldValueError(
            attribute.name,
            f"{value!r} cannot name a reward term: use letters, digits, '_', '.' or '-', and not "
            f"{', '.join(RESERVED_TERM_NAMES)}",
        )


def _check_weight(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise FieldValueError(attribute.name, f"must be a finite number, got {value}")


@attrs.frozen(kw_only=True)
class RewardTerm:
    """One term of the reward: ``weight * fn(episode)``.

    Args:
        name: the term's name in metrics (``rollout/reward/<name>``, ``eval/<lesson>/reward/<name>``)
            and in saved rollouts.
        fn: the reward plugin that computes it (``marinrl plugins --kind reward``): ``env`` (the
            env's own score), ``length``, ``format``, ``judge`` or an installed one; empty: ``name``.
        weight: its factor in the total (negative for a penalty).
        config: the plugin's settings (the fields of its config class).
    """

    name: str = attrs.field(validator=_check_name)
    fn: str = ""
    weight: float = attrs.field(default=1.0, converter=float, validator=_check_weight)
    config: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def plugin(self) -> str:
        return self.fn or self.name


@attrs.frozen(kw_only=True)
class RewardConfig:
    """How an episode's reward is made (``[reward]``).

    Args:
        terms: the reward is the weighted sum of these terms, each logged on its own; empty (the
            default): the env's own reward alone, as if one term ``env`` of weight 1. A term
            that cannot grade an episode (its plugin returns ``None`` for it, or raises) drops
            that episode's problem from the batch, counted in ``rollout/reward_failures``:
            never a silent 0.
        max_failed_batches: after this many batches in a row in which one term could not
            grade most episodes (a judge that is down), the job stops, naming the term and its
            last error; its checkpoints are kept for ``--resume``.
    """

    terms: tuple[RewardTerm, ...] = attrs.field(default=(), converter=tuple)
    max_failed_batches: int = attrs.field(default=3, validator=attrs.validators.ge(1))
