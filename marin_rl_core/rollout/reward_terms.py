"""A reward combined from several terms (``[[reward.terms]]``, issue 62): each term a reward
plugin's grade of a finished episode, the reward their weighted sum.

:class:`RewardTerms` grades a batch's episodes after the env has scored them: every term's
plugin is called once with all of them (a judge batches its requests), each episode's rollouts
are rewarded again, and each term's value is kept on them (``Rollout.reward_terms``) and
averaged into the batch's metrics (``rollout/reward/<term>``, ``eval/<lesson>/reward/<term>``).

How the total lands on the tokens: a term of the ``env`` plugin (the env's own score) keeps the
env's rewards where the env put them (each turn's, or per token), times its weight; every other
term's weighted value is added to the episode's last turn (a single-turn episode: its one
turn). ``Rollout.reward`` is the total.

A term that cannot grade an episode (its plugin returns ``None`` for it or a value that is not a
finite number, or raises for the whole call) never becomes a 0: the problem of that episode is
dropped from the batch (an RLOO group needs every sample of the problem), counted in
``rollout/reward_failures`` and logged with the term's name and error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.registry import Registry
from marin_rl_core.types import Problem, RewardInput, Rollout, SamplingParams

logger = logging.getLogger(__name__)

TERM_METRIC_PREFIX = "reward/"
"""A term's metric: ``reward/<name>`` (``rollout/reward/<name>``, ``eval/<lesson>/reward/<name>``)."""

ENV_PLUGIN = "env"
"""The reward plugin that is the env's own score: its term keeps the env's rewards in place."""


@attrs.define
class Graded:
    """What :meth:`RewardTerms.grade` did to a batch."""

    failed: set[int] = attrs.field(factory=set)
    """Indices of the problems dropped: a term could not grade one of their episodes."""
    failures: int = 0
    """Episodes a term could not grade."""
    seconds: float = 0.0
    """Spent in the terms' plugins."""

    def metrics(self) -> dict[str, float]:
        """``reward_failures`` (episodes a term could not grade) and ``reward_seconds``."""
        return {"reward_failures": float(self.failures), "reward_seconds": self.seconds}


def response_text(rollouts: Sequence[Rollout], tokenizer: Any, stops: set[int]) -> str:
    """An episode's response as its env read it: its rollouts' response tokens decoded, without
    the sampled ``stops`` that ended its turns (observations between turns kept)."""

    def text(r: Rollout) -> str:
        sampled = r.loss_mask[r.prompt_length :].tolist()
        tokens = r.response_tokens.tolist()
        return tokenizer.decode(
            [t for t, m in zip(tokens, sampled, strict=True) if not (m and t in stops)]
        )

    return "".join(text(r) for r in rollouts)


class RewardTerms:
    """The run's ``[[reward.terms]]``, built (each plugin once) for one process."""

    def __init__(self, config: RLJobConfig, registry: Registry, tokenizer: Any):
        from marin_rl_core.config.converter import make_converter

        converter = make_converter(registry)
        self.terms = config.reward.terms
        self.functions = []
        for term in self.terms:
            record = registry.get("reward", term.plugin)
            settings = converter.structure(dict(term.config), record.config_class)
            self.functions.append(record.build(settings))
        self.tokenizer = tokenizer
        self.max_failed_batches = config.reward.max_failed_batches
        self._logged: dict[str, float] = {}
        self._failed_in_a_row = [0] * len(self.terms)
        self.last_error = [""] * len(self.terms)

    @property
    def active(self) -> bool:
        """Whether the run combines terms (else the env's reward is the reward, untouched)."""
        return bool(self.terms)

    def grade(
        self,
        problems: Sequence[Problem],
        results: Sequence[Sequence[Any]],
        lesson_id: str,
        mode: str,
        sampling: SamplingParams | None = None,
    ) -> Graded:
        """Grade every episode of ``results`` (per problem, its episodes'
        :class:`~marin_rl_core.rollout.episode_state.EpisodeResult` s; failed ones skipped) and
        reward their rollouts again, in place; each term's value goes into the episode's
        ``metrics`` as ``reward/<name>``. A term reads each response's text as the env does:
        without the sampled stop tokens that ended its turns (EOS, the template's end of turn,
        the checkpoint's and ``sampling``'s stops)."""
        graded = Graded()
        if not self.active:
            return graded
        episodes = [
            (p, result)
            for p, problem_results in enumerate(results)
            for result in problem_results
            if result.failure is None and result.rollouts
        ]
        from marin_rl_core.models.tokenizer import response_stop_ids

        stops = set(response_stop_ids(self.tokenizer, sampling.stop_tokens if sampling else ()))
        items = [
            self._item(problems[p], result.rollouts, lesson_id=lesson_id, mode=mode, stops=stops)
            for p, result in episodes
        ]
        start = time.monotonic()
        values = [self._score(i, items) for i in range(len(self.terms))]
        graded.seconds = time.monotonic() - start
        self._stop_if_failing(values)
        for k, (p, result) in enumerate(episodes):
            row = [values[i][k] for i in range(len(self.terms))]
            if any(v is None for v in row):
                graded.failed.add(p)
                graded.failures += 1
                continue
            result.rollouts = self._rewarded(result.rollouts, row)  # type: ignore[arg-type]
            for term, value in zip(self.terms, row, strict=True):
                result.metrics[TERM_METRIC_PREFIX + term.name] = float(value)  # type: ignore[arg-type]
        return graded

    def _stop_if_failing(self, values: list[list[float | None]]) -> None:
        """Count, per term, batches in a row in which it could not grade most episodes (a
        cache may still answer a few while a judge is down); stop the job at ``[reward]
        max_failed_batches`` of them (the stall watchdog's way: what, why, what to do)."""
        from marin_rl_core.errors import RESUME_HINT, StalledError

        for i, got in enumerate(values):
            failed = 2 * sum(v is None for v in got) > len(got)
            self._failed_in_a_row[i] = self._failed_in_a_row[i] + 1 if failed else 0
            if self._failed_in_a_row[i] >= self.max_failed_batches:
                term = self.terms[i]
                raise StalledError(
                    f"reward term {term.name!r} (fn {term.plugin}) could not grade most episodes "
                    f"of {self._failed_in_a_row[i]} batches in a row (reward.max_failed_batches);"
                    f" its last error: {self.last_error[i] or 'none given'}. Bring what it "
                    f"depends on back (a judge's endpoint), then resume the run with "
                    f"`{RESUME_HINT}`: judgments already made are read from its cache."
                )

    def _item(
        self,
        problem: Problem,
        rollouts: Sequence[Rollout],
        *,
        lesson_id: str,
        mode: str,
        stops: set[int],
    ) -> RewardInput:
        text = response_text(rollouts, self.tokenizer, stops)
        return RewardInput(
            problem=problem,
            response=text,
            response_tokens=sum(r.num_policy_tokens for r in rollouts),
            env_reward=float(rollouts[0].reward),
            truncated=any(r.truncated for r in rollouts),
            lesson_id=lesson_id,
            mode=mode,
        )

    def _score(self, i: int, items: list[RewardInput]) -> list[float | None]:
        """Term ``i``'s values of ``items``: ``None`` where it could not grade one."""
        term = self.terms[i]
        if not items:
            return []
        try:
            got = list(self.functions[i].score(items))
            if len(got) != len(items):
                raise ValueError(f"returned {len(got)} values for {len(items)} episodes")
        except Exception as exc:  # noqa: BLE001 - a term's failure drops its episodes, logged
            self.last_error[i] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            self._warn(term.name, self.last_error[i], len(items))
            return [None] * len(items)
        values: list[float | None] = []
        for value in got:
            try:
                number = None if value is None else float(value)
            except (TypeError, ValueError):
                number = None
            values.append(number if number is not None and math.isfinite(number) else None)
        missing = sum(v is None for v in values)
        if missing:
            said = getattr(self.functions[i], "last_error", "")  # a judge says why
            self.last_error[i] = said or "no grade (None or not a finite number)"
            self._warn(term.name, self.last_error[i], missing)
        return values

    def _warn(self, name: str, what: str, count: int) -> None:
        now = time.monotonic()
        if now - self._logged.get(name, -1e9) < 60:  # once a minute per term: counted anyway
            return
        self._logged[name] = now
        logger.warning(
            "reward term %r could not grade %d episode(s): %s; their problems are left out of "
            "the batch (counted in rollout/reward_failures)",
            name,
            count,
            what,
        )

    def _rewarded(self, rollouts: Sequence[Rollout], values: Sequence[float]) -> list[Rollout]:
        """The episode's rollouts with the total reward: the env's own rewards (turn or token)
        times the ``env`` terms' weight, every other weighted term on the last turn."""
        terms = self.terms
        total = sum(t.weight * v for t, v in zip(terms, values, strict=True))
        scale = sum(t.weight for t in terms if t.plugin == ENV_PLUGIN)
        extra = sum(
            t.weight * v for t, v in zip(terms, values, strict=True) if t.plugin != ENV_PLUGIN
        )
        named = {t.name: float(v) for t, v in zip(terms, values, strict=True)}
        out = []
        for j, r in enumerate(rollouts):
            last = j == len(rollouts) - 1
            turns = r.turn_rewards * np.float32(scale)
            tokens = r.token_rewards * np.float32(scale)
            if last and turns.size:
                turns[-1] += np.float32(extra)
            if last and tokens.size:
                sampled = np.flatnonzero(r.loss_mask)
                if sampled.size:
                    tokens[sampled[-1]] += np.float32(extra)
            out.append(
                attrs.evolve(
                    r, reward=total, turn_rewards=turns, token_rewards=tokens, reward_terms=named
                )
            )
        return out
