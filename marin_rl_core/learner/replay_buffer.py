"""The trainer's replay buffer: rollouts waiting to be trained on, with their advantages.

Rollouts arrive in batches from rollout storage. At ingestion the buffer computes each group's
advantages with the loss module (over the whole group, before any rollout of it is dropped), then
keeps each rollout unless it is stale:

* by weight step: ``metadata.weight_step < current_step - max_rollout_step_delay``;
* by age: ``clock() - metadata.timestamp > max_rollout_timestamp_delay`` seconds.

The same rules prune the held rollouts whenever the trainer's step advances
(:meth:`ReplayBuffer.set_current_step`), and the age rule again before each sample. A negative
delay turns its rule off. Beyond ``capacity`` the oldest rollouts are evicted.

:meth:`ReplayBuffer.sample` draws whole groups where it can, newer groups more often (group
weight ``(1 + rank_from_oldest) ** recency_alpha``), and returns exactly ``n`` rollouts or
``None``. A group whose advantages are all zero carries no policy gradient: its weight is
multiplied by ``uninformative_group_weight``, and at 0 such groups only fill what informative
groups leave of a batch. A rollout leaves the buffer once ``max_samples_per_rollout`` batches
have used it.

Thread-safe: the trainer may ingest on one thread and sample on another.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np

from marin_rl_core.config.schema import ReplayBufferConfig
from marin_rl_core.learner.replay_metrics import EnvCounters, buffer_metrics
from marin_rl_core.protocols import RLLossModule
from marin_rl_core.types import Rollout, RolloutBatch, RolloutGroup


@attrs.define
class _Entry:
    rollout: Rollout
    advantage: float
    group: int
    uses: int = 0

    @property
    def env(self) -> str:
        return self.rollout.env_name


class ReplayBuffer:
    """Holds rollouts and their advantages for the trainer; see the module docstring.

    Args:
        config: capacity, staleness limits, recency weighting and reuse limit.
        loss: the RL loss module; its ``compute_advantages(group)`` runs at ingestion.
        seed: seeds the sampling.
        clock: returns the current time in seconds, comparable with
            ``RolloutMetadata.timestamp`` (tests inject a fake clock).
    """

    def __init__(
        self,
        config: ReplayBufferConfig,
        loss: RLLossModule,
        *,
        seed: int,
        clock: Callable[[], float] = time.time,
    ):
        if config.capacity < 1:
            raise ValueError(f"replay_buffer.capacity must be >= 1, got {config.capacity}")
        if config.recency_alpha < 0:
            raise ValueError(
                f"replay_buffer.recency_alpha must be >= 0, got {config.recency_alpha}"
            )
        if config.max_samples_per_rollout < 1:
            raise ValueError(
                "replay_buffer.max_samples_per_rollout must be >= 1, got "
                f"{config.max_samples_per_rollout}"
            )
        self.config = config
        self._loss = loss
        self._clock = clock
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._entries: list[_Entry] = []  # oldest first
        self._next_group = 0
        self._current_step = 0
        self._window: defaultdict[str, EnvCounters] = defaultdict(EnvCounters)
        self._accepted_total: defaultdict[str, int] = defaultdict(int)
        self._used_total: defaultdict[str, int] = defaultdict(int)
        self._unused_dropped: dict[str, int] = defaultdict(int)  # by worker, see unused_dropped

    # --- state ---------------------------------------------------------------------------------

    @property
    def current_step(self) -> int:
        return self._current_step

    def __len__(self) -> int:
        return len(self._entries)

    def set_current_step(self, step: int) -> None:
        """Record the trainer's step and drop the rollouts that became stale."""
        with self._lock:
            self._current_step = int(step)
            self._prune(self._clock())

    def _stale_reason(self, rollout: Rollout, now: float) -> str | None:
        meta = rollout.metadata
        assert meta is not None
        step_delay = self.config.max_rollout_step_delay
        if step_delay >= 0 and meta.weight_step < self._current_step - step_delay:
            return "dropped_stale_step"
        time_delay = self.config.max_rollout_timestamp_delay
        if time_delay >= 0 and now - meta.timestamp > time_delay:
            return "dropped_stale_time"
        return None

    def _prune(self, now: float) -> None:
        kept = []
        for entry in self._entries:
            reason = self._stale_reason(entry.rollout, now)
            if reason is None:
                kept.append(entry)
            else:
                counters = self._window[entry.env]
                setattr(counters, reason, getattr(counters, reason) + 1)
                self._count_unused(entry.rollout, entry.uses)
        self._entries = kept

    def _count_unused(self, rollout: Rollout, uses: int = 0) -> None:
        if uses == 0:
            assert rollout.metadata is not None  # add_batches refuses rollouts without it
            self._unused_dropped[rollout.metadata.worker_id] += 1

    def unused_dropped(self, worker_id: str) -> int:
        """How many rollouts of rollout worker ``worker_id`` were dropped (stale or evicted)
        without ever being trained on, since this buffer was made. A paced worker generates
        them again (thread-safe; not kept in checkpoints: a restarted worker has a new id)."""
        with self._lock:
            return self._unused_dropped.get(worker_id, 0)

    # --- ingestion -----------------------------------------------------------------------------

    def add_batches(self, batches: Iterable[RolloutBatch], *, current_step: int) -> None:
        """Compute advantages for every group of ``batches`` and keep the fresh rollouts.

        ``current_step`` is the trainer's step now (as with :meth:`set_current_step`, held
        rollouts that became stale are dropped too). Empty batches and groups are skipped.

        Raises:
            ValueError: a rollout has no metadata (nothing is added then), or the loss module
                returned the wrong number of advantages for a group.
        """
        batches = list(batches)
        for b, batch in enumerate(batches):
            for g, group in enumerate(batch.groups):
                for r, rollout in enumerate(group.rollouts):
                    if rollout.metadata is None:
                        raise ValueError(
                            f"rollout {r} of group {g} of batch {b} (env {rollout.env_name!r}, "
                            f"problem {rollout.problem_id!r}) has no metadata, so its staleness "
                            "cannot be checked. The rollout worker must attach RolloutMetadata "
                            "(rollout.with_metadata(...)) before writing rollouts to storage."
                        )
        with self._lock:
            self._current_step = int(current_step)
            now = self._clock()
            self._prune(now)
            for batch in batches:
                for group in batch.groups:
                    if group.rollouts:
                        self._add_group(group, now)
            self._evict_over_capacity()

    def _add_group(self, group: RolloutGroup, now: float) -> None:
        rollouts = group.rollouts
        advantages = episode_advantages(self._loss, group)
        group_id = self._next_group
        self._next_group += 1
        rewards = np.asarray([r.reward for r in rollouts if r.part == 0], dtype=np.float64)
        counters = self._window[rollouts[0].env_name]
        counters.groups += 1
        counters.zero_variance_groups += bool(np.all(rewards == rewards[0]))
        for rollout, advantage in zip(rollouts, advantages, strict=True):
            counters = self._window[rollout.env_name]
            reason = self._stale_reason(rollout, now)
            if reason is None and not np.isfinite(advantage):  # the loss drops it
                reason = "dropped_by_loss"
            if reason is not None:
                setattr(counters, reason, getattr(counters, reason) + 1)
                self._count_unused(rollout)
                continue
            self._entries.append(
                _Entry(rollout=rollout, advantage=float(advantage), group=group_id)
            )
            counters.new_rollouts += 1
            counters.new_tokens += rollout.num_tokens
            counters.new_generated_tokens += rollout.num_policy_tokens
            counters.new_truncated += bool(rollout.truncated)
            counters.reward_sum += rollout.reward
            counters.reward_sq_sum += rollout.reward**2
            self._accepted_total[rollout.env_name] += 1

    def _evict_over_capacity(self) -> None:
        excess = len(self._entries) - self.config.capacity
        if excess > 0:
            for entry in self._entries[:excess]:
                self._window[entry.env].evicted += 1
                self._count_unused(entry.rollout, entry.uses)
            self._entries = self._entries[excess:]

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> tuple[bytes, dict[str, Any]]:
        """What a checkpoint keeps, so that a resumed run samples as this one would: the held
        rollouts as Arrow IPC bytes (:mod:`~marin_rl_core.rollout_serialization`, one group
        per rollout) and JSON-able state (each one's advantage, group and uses, the sampling
        RNG, the step and the totals)."""
        from marin_rl_core.rollout_serialization import serialize_rollout_batch

        with self._lock:
            batch = RolloutBatch(
                groups=[RolloutGroup(rollouts=(e.rollout,)) for e in self._entries]
            )
            state = {
                "advantages": [e.advantage for e in self._entries],
                "groups": [e.group for e in self._entries],
                "uses": [e.uses for e in self._entries],
                "next_group": self._next_group,
                "current_step": self._current_step,
                "rng": self._rng.bit_generator.state,
                "accepted_total": dict(self._accepted_total),
                "used_total": dict(self._used_total),
                "saved_at": self._clock(),
            }
            return serialize_rollout_batch(batch), state

    def load_state_dict(self, data: bytes, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        The time the job was down does not age the rollouts: their timestamps move forward by
        the time since the checkpoint was saved, so ``max_rollout_timestamp_delay`` counts
        only time the job ran (a preemption that kept a job down longer would otherwise drop the
        whole buffer, whose batches the rollout workers never generate again).

        Raises:
            ValueError: the bytes and the state do not belong together (a damaged checkpoint).
        """
        from marin_rl_core.rollout_serialization import deserialize_rollout_batch

        rollouts = deserialize_rollout_batch(data).rollouts
        downtime = self._clock() - float(state.get("saved_at", self._clock()))
        if downtime > 0:
            rollouts = [
                r.with_metadata(attrs.evolve(r.metadata, timestamp=r.metadata.timestamp + downtime))
                if r.metadata is not None
                else r
                for r in rollouts
            ]
        columns = [state["advantages"], state["groups"], state["uses"]]
        if any(len(c) != len(rollouts) for c in columns):
            raise ValueError(
                f"replay buffer state lists {len(columns[0])} rollouts, its data {len(rollouts)}"
            )
        with self._lock:
            self._entries = [
                _Entry(rollout=r, advantage=float(a), group=int(g), uses=int(u))
                for r, a, g, u in zip(rollouts, *columns, strict=True)
            ]
            self._next_group = int(state["next_group"])
            self._current_step = int(state["current_step"])
            self._rng.bit_generator.state = state["rng"]
            self._accepted_total = defaultdict(int, state["accepted_total"])
            self._used_total = defaultdict(int, state["used_total"])

    # --- sampling ------------------------------------------------------------------------------

    def sample(self, n: int) -> tuple[list[Rollout], np.ndarray] | None:
        """Draw exactly ``n`` distinct rollouts and their float32 advantages ``[n]``.

        Groups are drawn without replacement, newer groups more likely; a drawn group is taken
        whole while it fits, and the last places are filled from groups that did not fit. The
        rollouts of one group are adjacent in the result. Each returned rollout counts one use.

        Returns:
            ``None`` (and changes nothing) when fewer than ``n`` rollouts are held: the trainer
            should read more rollouts and try again. Never a smaller batch.
        """
        if n < 1:
            raise ValueError(f"sample size must be >= 1, got {n}")
        with self._lock:
            self._prune(self._clock())
            if len(self._entries) < n:
                return None
            groups: dict[int, list[int]] = {}
            for i, entry in enumerate(self._entries):  # oldest group first
                groups.setdefault(entry.group, []).append(i)
            # A group with too few rollouts left gives noisy group-relative advantages.
            members = [m for m in groups.values() if len(m) >= self.config.min_group_size]
            if sum(len(m) for m in members) < n:
                return None
            informative = np.asarray(
                [any(self._entries[i].advantage != 0.0 for i in m) for m in members]
            )
            order = [int(k) for k in self._sampling_order(informative)]
            envs = {self._entries[m[0]].env for m in members}
            if self.config.env_token_fractions and len(envs) > 1:
                order = self._order_by_token_budget(members, order, n)

            chosen: list[int] = []
            skipped: list[list[int]] = []
            for k in order:
                if len(chosen) == n:
                    break
                if len(members[k]) <= n - len(chosen):
                    chosen.extend(members[k])
                else:
                    skipped.append(members[k])
            for group in skipped:
                if len(chosen) == n:
                    break
                picked = self._rng.permutation(group)[: n - len(chosen)]
                chosen.extend(int(i) for i in sorted(picked))

            rollouts = [self._entries[i].rollout for i in chosen]
            advantages = np.asarray([self._entries[i].advantage for i in chosen], np.float32)
            for i in chosen:
                entry = self._entries[i]
                entry.uses += 1
                self._window[entry.env].sampled_rollouts += 1
                self._window[entry.env].sampled_tokens += entry.rollout.num_tokens
                if entry.uses == 1:
                    self._used_total[entry.env] += 1
            limit = self.config.max_samples_per_rollout
            self._entries = [e for e in self._entries if e.uses < limit]
            return rollouts, advantages

    def _env_shares(self, envs: set[str]) -> dict[str, float]:
        """Each env's share of a batch's tokens: its configured fraction, or an equal part of
        what the named envs leave; normalised over ``envs``."""
        named = {e: f for e, f in self.config.env_token_fractions.items() if e in envs}
        rest = [e for e in envs if e not in self.config.env_token_fractions]
        left = max(0.0, 1.0 - sum(self.config.env_token_fractions.values()))
        shares = {**named, **{e: left / len(rest) for e in rest}} if rest else named
        total = sum(shares.values())
        if total <= 0:
            return {e: 1.0 / len(envs) for e in envs}
        return {e: shares.get(e, 0.0) / total for e in envs}

    def _order_by_token_budget(
        self, members: list[list[int]], order: list[int], n: int
    ) -> list[int]:
        """``order`` rearranged so that a batch filled from its front meets each env's token
        share: round robin by token deficit (the env furthest below its share of the tokens
        taken so far gives its next group, in ``order``); groups of envs with no share come
        last."""
        queues: dict[str, list[int]] = defaultdict(list)
        for k in order:
            queues[self._entries[members[k][0]].env].append(k)
        shares = self._env_shares(set(queues))
        taken: dict[str, float] = defaultdict(float)
        total = rollouts = 0
        out: list[int] = []
        while rollouts < n and any(queues[e] for e in shares if shares[e] > 0):
            env = max(
                (e for e in sorted(queues) if queues[e] and shares[e] > 0),
                key=lambda e: shares[e] * (total + 1) - taken[e],
            )
            k = queues[env].pop(0)
            tokens = sum(self._entries[i].rollout.num_tokens for i in members[k])
            taken[env] += tokens
            total += tokens
            rollouts += len(members[k])
            out.append(k)
        seen = set(out)
        return out + [k for k in order if k not in seen]

    def _sampling_order(self, informative: np.ndarray) -> np.ndarray:
        """Group indices (0 = oldest) in a random order where group ``k`` comes early with
        weight ``(1 + k) ** alpha``, times ``uninformative_group_weight`` for a group that is not
        ``informative``: Gumbel-top-k, i.e. weighted sampling without replacement. A weight of 0
        puts the uninformative groups after every informative one, still newest-first."""
        num_groups = informative.shape[0]
        keys = self.config.recency_alpha * np.log1p(np.arange(num_groups))
        keys = keys + self._rng.gumbel(size=num_groups)
        weight = self.config.uninformative_group_weight
        if weight == 0.0:
            return np.lexsort((-keys, ~informative))  # informative first, then by key
        if weight != 1.0:
            keys = keys + np.where(informative, 0.0, math.log(weight))
        return np.argsort(-keys, kind="stable")

    # --- metrics -------------------------------------------------------------------------------

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """The buffer's metrics, overall (``NAME``) and per env (``ENV/NAME``).

        State now: ``rollouts_in_buffer``, ``tokens_in_buffer`` (prompt + response),
        ``frac_on_policy`` (held rollouts whose ``weight_step >= current_step``).

        Since the last ``metrics(reset=True)``: ``new_rollouts``, ``new_tokens``,
        ``new_generated_tokens``, ``reward/mean``, ``reward/std`` and ``frac_truncated`` of the
        rollouts accepted; ``dropped_stale_step``, ``dropped_stale_time``, ``evicted``,
        ``dropped_by_loss`` (the loss gave them a NaN advantage: a group without variance);
        ``sampled_rollouts`` (uses in batches); ``frac_zero_variance_groups`` (groups received
        whose rewards are all equal, so they carry no learning signal).

        Since the buffer was made: ``frac_used``, the fraction of accepted rollouts that at
        least one batch used.

        A ratio with nothing to divide by (say ``reward/mean`` with no new rollouts) is left
        out rather than reported as 0.
        """
        with self._lock:
            out = buffer_metrics(
                [entry.rollout for entry in self._entries],
                self._window,
                self._accepted_total,
                self._used_total,
                current_step=self._current_step,
            )
            if reset:
                self._window.clear()
            return out


def episode_advantages(loss: RLLossModule, group: RolloutGroup) -> np.ndarray:
    """One advantage per rollout of ``group``, computed over its episodes.

    An episode split into several parts (``Rollout.part`` > 0 follows its part 0) counts once:
    the loss sees the group of part-0 rollouts, and each later part takes its episode's
    advantage."""
    rollouts = group.rollouts
    heads = [i for i, r in enumerate(rollouts) if r.part == 0]
    episodes = (
        group
        if len(heads) == len(rollouts)
        else RolloutGroup(rollouts=[rollouts[i] for i in heads])
    )
    advantages = np.asarray(loss.compute_advantages(episodes), dtype=np.float32).reshape(-1)
    if advantages.shape[0] != len(episodes.rollouts):
        raise ValueError(
            f"{type(loss).__name__}.compute_advantages returned {advantages.shape[0]} "
            f"advantages for a group of {len(episodes.rollouts)} rollouts; it must return one each"
        )
    if len(heads) == len(rollouts):
        return advantages
    if not heads or heads[0] != 0:
        raise ValueError("a rollout group must start with part 0 of an episode")
    episode_of = np.cumsum([r.part == 0 for r in rollouts]) - 1
    return advantages[episode_of]
