"""Checks of a structured config that need more than one field: lesson ids and their dependency
graph, each lesson's env config, batch sizes."""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Mapping, Sequence

from cattrs.errors import ClassValidationError, IterableValidationError

from marin_rl_core.config.converter import format_structure_error, make_converter
from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ConfigError
from marin_rl_core.registry import Registry


def validate_config(config: RLJobConfig, registry: Registry, converter=None) -> None:  # type: ignore[no-untyped-def]
    """Checks that need more than one field: lesson ids and dependencies (a DAG), lesson env
    configs, batch sizes. Raises :class:`ConfigError` naming the path."""
    converter = converter or make_converter(registry)
    lessons = config.curriculum.lessons
    ids = [lesson.id for lesson in lessons]
    errors: list[str] = []
    for i, lesson in enumerate(lessons):
        path = f"$.curriculum.lessons[{i}]"
        if ids.count(lesson.id) > 1:
            errors.append(f"{path}.id: lesson id {lesson.id!r} is used more than once")
        for j, dep in enumerate(lesson.dependencies):
            if dep.lesson not in ids:
                close = difflib.get_close_matches(dep.lesson, ids, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(
                    f"{path}.dependencies[{j}].lesson: no lesson {dep.lesson!r}{hint}; "
                    f"lessons: {', '.join(ids)}"
                )
        env_name = lesson.env or config.env.name
        record = registry.get("env", env_name, where=f"{path}.env")
        base = converter.unstructure(config.env.config) if env_name == config.env.name else {}
        base.update(dict(lesson.env_config))
        try:
            converter.structure(base, record.config_class)
        except (ClassValidationError, IterableValidationError) as exc:
            errors.append(format_structure_error(exc, base, prefix=f"{path}.env_config").strip())
    cycle = _find_cycle({lesson.id: [d.lesson for d in lesson.dependencies] for lesson in lessons})
    if cycle:
        errors.append(f"$.curriculum.lessons: dependencies form a cycle: {' -> '.join(cycle)}")
    for i, lesson in enumerate(lessons):
        sampling, evaluating = config.sampling_for(lesson), config.eval_sampling_for(lesson)
        if evaluating.max_tokens < sampling.max_tokens:
            own = f"$.curriculum.lessons[{i}].eval_sampling.max_tokens"
            where = own if lesson.eval_sampling else "$.eval.sampling.max_tokens"
            fix = own if lesson.eval_sampling else f"{own} (or {where})"
            errors.append(
                f"{where}: lesson {lesson.id!r} is evaluated with {evaluating.max_tokens} tokens "
                f"but trained with {sampling.max_tokens}, so eval would cut its answers short and "
                f"score them 0; set {fix} to at least {sampling.max_tokens}"
            )
        path = f"$.curriculum.lessons[{i}].sampling" if lesson.sampling else "$.sampling"
        if config.trainer.batch_size % sampling.n_generations_per_prompt:
            errors.append(
                f"$.trainer.batch_size: {config.trainer.batch_size} is not a multiple of "
                f"{path}.n_generations_per_prompt ({sampling.n_generations_per_prompt}), so "
                "training batches would split groups"
            )
    rb, t = config.replay_buffer, config.trainer
    if t.sync_interval_steps > rb.max_rollout_step_delay + 1:
        errors.append(
            f"$.trainer.sync_interval_steps: weights published every {t.sync_interval_steps} steps "
            f"go stale after $.replay_buffer.max_rollout_step_delay + 1 = "
            f"{rb.max_rollout_step_delay + 1} steps, so between publishes the trainer would wait "
            "for rollouts that can never arrive; use sync_interval_steps <= "
            "max_rollout_step_delay + 1"
        )
    if rb.capacity < t.batch_size:
        errors.append(
            f"$.replay_buffer.capacity: {rb.capacity} rollouts can never fill a training batch of "
            f"$.trainer.batch_size = {t.batch_size}; raise the capacity to at least the batch size"
        )
    fractions = dict(rb.env_token_fractions)
    lesson_envs = {lesson.env or config.env.name for lesson in config.curriculum.lessons}
    unknown = sorted(set(fractions) - lesson_envs)
    if unknown:
        errors.append(
            f"$.replay_buffer.env_token_fractions: {', '.join(unknown)} is not the env of any "
            f"lesson (they use {', '.join(sorted(lesson_envs))})"
        )
    if any(not 0 <= f <= 1 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-6:
        errors.append(
            "$.replay_buffer.env_token_fractions: each share must be in [0, 1] and together at "
            f"most 1, got {fractions}"
        )
    micro = config.trainer.microbatch_size
    if micro and config.trainer.batch_size % micro:
        errors.append(
            f"$.trainer.microbatch_size: {micro} does not divide $.trainer.batch_size "
            f"({config.trainer.batch_size}); pick a divisor such as "
            f"{max(d for d in range(1, micro + 1) if config.trainer.batch_size % d == 0)}"
        )
    errors.extend(_loss_plan_errors(config, registry))
    errors.extend(_reward_term_errors(config, registry, converter))
    if "tensorboard" in config.logging.tracker and importlib.util.find_spec("tensorboardX") is None:
        errors.append(
            '$.logging.tracker: "tensorboard" needs the tensorboardX package, which is not '
            "installed: pip install 'marin-rl[tensorboard]'"
        )
    if config.num_rollout_workers < 1:
        errors.append(f"$.num_rollout_workers: must be >= 1, got {config.num_rollout_workers}")
    for name in (
        "num_train_steps",
        "batch_size",
        "sync_interval_steps",
        "checkpoint_interval_steps",
    ):
        if getattr(config.trainer, name) < 1:
            errors.append(f"$.trainer.{name}: must be >= 1, got {getattr(config.trainer, name)}")
    for tracker in config.logging.tracker:
        if tracker not in ("jsonl", "wandb", "tensorboard"):
            errors.append(
                f"$.logging.tracker: unknown tracker {tracker!r}; choose from jsonl, wandb, tensorboard"
            )
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {e}" for e in dict.fromkeys(errors)))


def _loss_plan_errors(config: RLJobConfig, registry: Registry) -> list[str]:
    """What is wrong with the loss's plan (:class:`~marin_rl_core.protocols.LossPlan`: one it
    cannot give, or epochs, minibatches and frozen policy steps that do not fit this trainer)."""
    from marin_rl_core.protocols import loss_plan

    try:
        module = registry.get("loss", config.loss.name).build(config.loss.config)
    except Exception:  # noqa: BLE001 - a loss that cannot be built says so when the run builds it
        return []
    try:
        plan = loss_plan(module)
    except (TypeError, ValueError) as e:
        return [f"$.loss: the {config.loss.name!r} loss plugin's plan: {e}"]
    t, errors = config.trainer, []
    if t.batch_size % plan.minibatches:
        errors.append(
            f"$.loss.minibatches: {plan.minibatches} minibatches cannot split $.trainer.batch_size "
            f"({t.batch_size}) evenly; choose a divisor of the batch size"
        )
    elif t.microbatch_size and (t.batch_size // plan.minibatches) % t.microbatch_size:
        errors.append(
            f"$.trainer.microbatch_size: {t.microbatch_size} does not divide a minibatch of "
            f"{t.batch_size // plan.minibatches} rollouts ($.trainer.batch_size / "
            "$.loss.minibatches); choose a divisor of the minibatch"
        )
    if plan.frozen_policy_steps >= t.num_train_steps:
        errors.append(
            f"$.loss.value_pretrain_steps: {plan.frozen_policy_steps} steps of value pretraining "
            f"leave none of the run's $.trainer.num_train_steps = {t.num_train_steps} to train "
            "the policy; use fewer"
        )
    return errors


def _reward_term_errors(config: RLJobConfig, registry: Registry, converter) -> list[str]:  # type: ignore[no-untyped-def]
    """``[[reward.terms]]``: names used once, each ``fn`` a reward plugin, each ``config`` its
    config class's."""
    errors: list[str] = []
    names = [term.name for term in config.reward.terms]
    for i, term in enumerate(config.reward.terms):
        path = f"$.reward.terms[{i}]"
        if names.count(term.name) > 1:
            errors.append(f"{path}.name: reward term {term.name!r} is named more than once")
        record = registry.get("reward", term.plugin, where=f"{path}.fn")
        try:
            converter.structure(dict(term.config), record.config_class)
        except (ClassValidationError, IterableValidationError) as exc:
            errors.append(
                format_structure_error(exc, dict(term.config), prefix=f"{path}.config").strip()
            )
    return errors


def _find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if state.get(nxt) is None and nxt in graph:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


__all__ = [
    "validate_config",
]
