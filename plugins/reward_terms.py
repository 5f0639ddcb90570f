"""Built-in reward functions: the terms a ``[[reward.terms]]`` list combines (issue 62).

=============  =================================================================  ==============
``fn``         the term's value                                                    config
=============  =================================================================  ==============
``env``        the env's own reward of the episode                                 (none)
``length``     the response's sampled tokens beyond ``free_tokens``, divided by    ``free_tokens``,
               ``per_tokens`` (give it a negative weight: a length penalty)        ``per_tokens``
``format``     1 when the response matches the regular expression ``pattern``     ``pattern``,
               (``re.search``), else 0                                             ``ignore_case``
=============  =================================================================  ==============
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs

from marin_rl_core import FieldValueError, RewardInput, RewardPlugin, hookimpl


@attrs.frozen(kw_only=True)
class EnvTermConfig:
    """The env's own reward takes no settings."""


class EnvTerm:
    def __init__(self, config: EnvTermConfig):
        self.config = config

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return [item.env_reward for item in items]


@attrs.frozen(kw_only=True)
class LengthConfig:
    """Args:
    free_tokens: sampled tokens that cost nothing.
    per_tokens: the value grows by 1 every this many tokens beyond ``free_tokens``.
    """

    free_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    per_tokens: float = attrs.field(default=1.0, converter=float, validator=attrs.validators.gt(0))


class LengthTerm:
    def __init__(self, config: LengthConfig):
        self.config = config

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        c = self.config
        return [max(0, item.response_tokens - c.free_tokens) / c.per_tokens for item in items]


def check_pattern(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    """An attrs validator: ``value`` is a regular expression."""
    try:
        re.compile(value)
    except re.error as exc:
        raise FieldValueError(
            attribute.name, f"{value!r} is not a regular expression: {exc}"
        ) from None


def check_template(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    """An attrs validator: ``value`` is a template of an episode's text, filling in only
    ``{prompt}``, ``{response}`` and ``{answer}``."""
    try:
        value.format(prompt="", response="", answer="")
    except (KeyError, IndexError, ValueError) as exc:
        raise FieldValueError(
            attribute.name,
            f"fills in only {{prompt}}, {{response}} and {{answer}} (write {{{{ and }}}} for "
            f"braces): {type(exc).__name__}: {exc}",
        ) from None


@attrs.frozen(kw_only=True)
class FormatConfig:
    """Args:
    pattern: a Python regular expression the response must contain (``re.search``; empty:
        every response does).
    ignore_case: match case-insensitively.
    """

    pattern: str = attrs.field(default="", validator=check_pattern)
    ignore_case: bool = False


class FormatTerm:
    def __init__(self, config: FormatConfig):
        self.regex = re.compile(config.pattern, re.IGNORECASE if config.ignore_case else 0)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return [1.0 if self.regex.search(item.response) else 0.0 for item in items]


@hookimpl
def marinrl_register_rewards() -> Any:
    yield RewardPlugin(
        name="env",
        summary="The env's own reward of the episode (its score).",
        config_class=EnvTermConfig,
        build=EnvTerm,
    )
    yield RewardPlugin(
        name="length",
        summary="Sampled tokens beyond free_tokens, per per_tokens (a penalty: weight < 0).",
        config_class=LengthConfig,
        build=LengthTerm,
    )
    yield RewardPlugin(
        name="format",
        summary="1 when the response matches a regular expression (config.pattern), else 0.",
        config_class=FormatConfig,
        build=FormatTerm,
    )
