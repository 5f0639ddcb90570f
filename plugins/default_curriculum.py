"""The ``default`` curriculum policy: dependencies, thresholds, plateaus, edge-of-competence sampling.

Lesson states:

* **locked** until every dependency's latest eval reward reaches that dependency's threshold
  (or the dependency graduates); once unlocked a lesson stays unlocked;
* **active** once unlocked: sampled with weight ``min_weight + 4 r (1 - r)`` where ``r`` is an
  exponential moving average of the lesson's training reward. The weight peaks at ``r = 0.5``,
  the edge of competence, where a group's samples disagree most and RLOO's gradient is largest.
  A lesson whose eval reward is below its ``start_threshold`` is not learnable yet: its weight is
  scaled by ``below_start_factor``. A lesson whose eval reward moved less than
  ``plateau_threshold`` over its last ``plateau_window`` evals has *plateaued* and its weight is
  scaled by ``plateau_factor``;
* **graduated** once it is unlocked and its eval reward reaches ``stop_threshold`` (a locked
  lesson that scores well stays locked until its dependencies are met): still evaluated, and still
  sampled with ``graduated_weight`` so that it is not forgotten. A graduated lesson whose eval
  reward falls below ``stop_threshold - regression_margin`` (it is being forgotten while newer
  lessons take the batches) is active again until it re-reaches ``stop_threshold``.

All state is plain data (``state_dict``) and saved beside the trainer's checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core import CurriculumPlugin, LessonConfig, LessonStats, hookimpl


@attrs.frozen(kw_only=True)
class DefaultCurriculumConfig:
    """Args:
    ema_alpha: weight of the newest training batch in a lesson's reward average.
    min_weight: sampling weight of an active lesson at reward 0 or 1.
    graduated_weight: sampling weight of a graduated lesson.
    regression_margin: a graduated lesson whose eval reward drops this far below its
        ``stop_threshold`` becomes active again.
    below_start_factor: weight multiplier while eval reward < ``start_threshold``.
    plateau_factor: weight multiplier for a plateaued lesson.
    """

    ema_alpha: float = attrs.field(
        default=0.3, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    min_weight: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))
    graduated_weight: float = attrs.field(default=0.25, validator=attrs.validators.ge(0.0))
    regression_margin: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))
    below_start_factor: float = attrs.field(default=0.5, validator=attrs.validators.ge(0.0))
    plateau_factor: float = attrs.field(default=0.5, validator=attrs.validators.ge(0.0))


class DefaultCurriculum:
    """Implements :class:`marin_rl_core.CurriculumPolicy`; see the module docstring."""

    def __init__(self, config: DefaultCurriculumConfig, lessons: Sequence[LessonConfig]):
        if not lessons:
            raise ValueError("a curriculum needs at least one lesson")
        self.config = config
        self.lessons = {lesson.id: lesson for lesson in lessons}
        self._train_ema: dict[str, float | None] = {lid: None for lid in self.lessons}
        self._eval_history: dict[str, list[float]] = {lid: [] for lid in self.lessons}
        self._graduated: set[str] = set()
        self._unlocked: set[str] = {
            lid for lid, lesson in self.lessons.items() if not lesson.dependencies
        }

    # --- state ---------------------------------------------------------------------------------

    def _latest_eval(self, lesson_id: str) -> float | None:
        history = self._eval_history[lesson_id]
        return history[-1] if history else None

    def _dependencies_met(self, lesson: LessonConfig) -> bool:
        for dep in lesson.dependencies:
            reward = self._latest_eval(dep.lesson)
            reached = dep.lesson in self._graduated or (
                reward is not None and reward >= dep.reward_threshold
            )
            if not reached:
                return False
        return True

    def plateaued(self, lesson_id: str) -> bool:
        lesson = self.lessons[lesson_id]
        history = self._eval_history[lesson_id]
        if len(history) < lesson.plateau_window:
            return False
        window = history[-lesson.plateau_window :]
        return max(window) - min(window) < lesson.plateau_threshold

    def lesson_states(self) -> dict[str, str]:
        states = {}
        for lid in self.lessons:
            if lid in self._graduated:
                states[lid] = "graduated"
            elif lid in self._unlocked:
                states[lid] = "active"
            else:
                states[lid] = "locked"
        return states

    def sampling_weights(self) -> dict[str, float]:
        """The probability each lesson is sampled next (sums to 1)."""
        cfg = self.config
        weights: dict[str, float] = {}
        states = self.lesson_states()
        for lid, state in states.items():
            if state == "locked":
                continue
            if state == "graduated":
                weights[lid] = cfg.graduated_weight
                continue
            r = self._train_ema[lid]
            w = 1.0 if r is None else cfg.min_weight + 4.0 * r * (1.0 - r)
            latest = self._latest_eval(lid)
            if latest is not None and latest < self.lessons[lid].start_threshold:
                w *= cfg.below_start_factor
            if self.plateaued(lid):
                w *= cfg.plateau_factor
            weights[lid] = w
        if not weights:  # every lesson locked: a dependency cycle cannot happen (validated)
            weights = {lid: 1.0 for lid in self.lessons if not self.lessons[lid].dependencies}
        total = sum(weights.values())
        return {lid: w / total for lid, w in weights.items()}

    # --- protocol ------------------------------------------------------------------------------

    def sample_lesson(self, *, seed: int) -> str:
        weights = self.sampling_weights()
        ids = list(weights)
        rng = np.random.default_rng(seed)
        return str(ids[rng.choice(len(ids), p=np.asarray([weights[i] for i in ids]))])

    def update_eval(self, stats: LessonStats) -> None:
        if not stats.n_rollouts:
            return  # nothing was scored: no evidence either way
        lid, reward = stats.lesson_id, float(stats.mean_reward)
        self._eval_history[lid].append(reward)
        stop = self.lessons[lid].stop_threshold
        if reward >= stop and lid in self._unlocked:  # a locked lesson is never sampled early
            self._graduated.add(lid)
        elif lid in self._graduated and reward < stop - self.config.regression_margin:
            self._graduated.discard(lid)
        for other, lesson in self.lessons.items():
            if other not in self._unlocked and self._dependencies_met(lesson):
                self._unlocked.add(other)

    def update_training(self, stats: LessonStats) -> None:
        prev = self._train_ema[stats.lesson_id]
        a = self.config.ema_alpha
        self._train_ema[stats.lesson_id] = (
            stats.mean_reward if prev is None else (1 - a) * prev + a * stats.mean_reward
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "train_ema": dict(self._train_ema),
            "eval_history": {k: list(v) for k, v in self._eval_history.items()},
            "graduated": sorted(self._graduated),
            "unlocked": sorted(self._unlocked),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state.get("eval_history", {})) - set(self.lessons)
        if unknown:
            raise ValueError(f"saved curriculum state has unknown lessons: {sorted(unknown)}")
        self._train_ema.update(state.get("train_ema", {}))
        for k, v in state.get("eval_history", {}).items():
            self._eval_history[k] = [float(x) for x in v]
        self._graduated = set(state.get("graduated", []))
        self._unlocked |= set(state.get("unlocked", [])) | self._graduated
        for lid, lesson in self.lessons.items():  # states saved before "unlocked" was recorded
            if self._dependencies_met(lesson):
                self._unlocked.add(lid)


@hookimpl
def marinrl_register_curricula():  # type: ignore[no-untyped-def]
    yield CurriculumPlugin(
        name="default",
        summary="Dependencies, start/stop thresholds, plateaus; samples lessons at the edge of competence.",
        config_class=DefaultCurriculumConfig,
        build=DefaultCurriculum,
    )
