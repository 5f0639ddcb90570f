"""The replay buffer's metrics: what happened to each env's rollouts since the last report
(:class:`EnvCounters`, which :class:`~marin_rl_core.learner.replay_buffer.ReplayBuffer` counts
into as rollouts arrive, go stale, are evicted or sampled) and the metrics reported from them and
from the rollouts held (:func:`buffer_metrics`), overall and per env. What each metric means is
documented at :meth:`~marin_rl_core.learner.replay_buffer.ReplayBuffer.metrics`."""

from __future__ import annotations

import math
from collections import defaultdict

import attrs

from marin_rl_core.types import Rollout


@attrs.define
class EnvCounters:
    """What happened to one env's rollouts since the last ``metrics(reset=True)``."""

    new_rollouts: int = 0
    new_tokens: int = 0
    new_generated_tokens: int = 0
    new_truncated: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    groups: int = 0
    zero_variance_groups: int = 0
    dropped_stale_step: int = 0
    dropped_stale_time: int = 0
    evicted: int = 0
    dropped_by_loss: int = 0
    sampled_rollouts: int = 0
    sampled_tokens: int = 0


def buffer_metrics(
    held: list[Rollout],
    window: defaultdict[str, EnvCounters],
    accepted_total: defaultdict[str, int],
    used_total: defaultdict[str, int],
    *,
    current_step: int,
) -> dict[str, float]:
    """The buffer's metrics, overall (``NAME``) and per env (``ENV/NAME``): see
    :meth:`~marin_rl_core.learner.replay_buffer.ReplayBuffer.metrics`.

    Args:
        held: the rollouts in the buffer now, oldest first.
        window: per env, the counters since the last reset (an env missing gets empty ones).
        accepted_total: per env, the rollouts accepted since the buffer was made.
        used_total: per env, the accepted rollouts that at least one batch used.
        current_step: the trainer's step (a held rollout of this weight step or newer is
            on-policy).
    """
    by_env: dict[str, list[Rollout]] = defaultdict(list)
    for rollout in held:
        by_env[rollout.env_name].append(rollout)
    envs = sorted(set(by_env) | set(window) | set(accepted_total))
    out: dict[str, float] = {}
    for env in envs:
        out.update(
            _env_metrics(
                f"{env}/",
                by_env[env],
                [window[env]],
                accepted_total[env],
                used_total[env],
                current_step=current_step,
            )
        )
    out.update(
        _env_metrics(
            "",
            held,
            [window[env] for env in envs],
            sum(accepted_total.values()),
            sum(used_total.values()),
            current_step=current_step,
        )
    )
    all_tokens = sum(window[env].sampled_tokens for env in envs)
    if all_tokens:
        for env in envs:
            out[f"{env}/frac_sampled_tokens"] = window[env].sampled_tokens / all_tokens
    return out


def _env_metrics(
    prefix: str,
    held: list[Rollout],
    windows: list[EnvCounters],
    accepted_total: int,
    used_total: int,
    *,
    current_step: int,
) -> dict[str, float]:
    def total(name: str) -> float:
        return float(sum(getattr(w, name) for w in windows))

    out = {
        "rollouts_in_buffer": float(len(held)),
        "tokens_in_buffer": float(sum(r.num_tokens for r in held)),
    }
    if held:
        on_policy = sum(_weight_step(r) >= current_step for r in held)
        out["frac_on_policy"] = on_policy / len(held)
    for name in (
        "new_rollouts",
        "new_tokens",
        "new_generated_tokens",
        "dropped_stale_step",
        "dropped_stale_time",
        "evicted",
        "dropped_by_loss",
        "sampled_rollouts",
        "sampled_tokens",
    ):
        out[name] = total(name)
    new = total("new_rollouts")
    if new:
        mean = total("reward_sum") / new
        out["reward/mean"] = mean
        out["reward/std"] = math.sqrt(max(0.0, total("reward_sq_sum") / new - mean**2))
        out["frac_truncated"] = total("new_truncated") / new
    if total("groups"):
        out["frac_zero_variance_groups"] = total("zero_variance_groups") / total("groups")
    if accepted_total:
        out["frac_used"] = used_total / accepted_total
    return {prefix + name: value for name, value in out.items()}


def _weight_step(rollout: Rollout) -> int:
    assert rollout.metadata is not None  # add_batches refuses rollouts without it
    return rollout.metadata.weight_step
