"""The replay buffer: staleness, capacity, reuse, recency weighting, groups and metrics."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from marin_rl_core import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata
from marin_rl_core.config import ReplayBufferConfig
from marin_rl_core.learner.replay_buffer import ReplayBuffer

NOW = 1_000_000.0


class LeaveOneOut:
    """Advantage = reward minus the mean reward of the group's other rollouts."""

    needs_reference_model = False

    def __init__(self):
        self.groups_seen = 0

    def build(self, reference_model):
        return self

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        self.groups_seen += 1
        rewards = group.rewards.astype(np.float64)
        if len(rewards) == 1:
            return np.zeros(1, np.float32)
        others = (rewards.sum() - rewards) / (len(rewards) - 1)
        return (rewards - others).astype(np.float32)

    def create_loss_fn(self, reference_model, train_model):
        raise NotImplementedError


class FakeClock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def rollout(
    problem: str,
    reward: float = 0.0,
    *,
    env: str = "math",
    step: int = 0,
    age: float = 0.0,
    n_prompt: int = 2,
    n_response: int = 3,
    truncated: bool = False,
    worker: str = "w",
) -> Rollout:
    return Rollout.single_turn(
        env_name=env,
        lesson_id="lesson",
        problem_id=problem,
        prompt_tokens=np.arange(n_prompt),
        response_tokens=np.arange(n_response),
        response_logprobs=np.full(n_response, -1.0),
        reward=reward,
        truncated=truncated,
        metadata=RolloutMetadata(worker_id=worker, timestamp=NOW - age, weight_step=step),
    )


def group(*rollouts: Rollout) -> RolloutGroup:
    return RolloutGroup(rollouts=rollouts)


def batch(*groups: RolloutGroup) -> RolloutBatch:
    return RolloutBatch(groups=groups)


def make_buffer(*, clock=None, loss=None, seed=0, **config) -> ReplayBuffer:
    defaults = dict(max_rollout_step_delay=1000, max_rollout_timestamp_delay=-1, recency_alpha=0)
    return ReplayBuffer(
        ReplayBufferConfig(**{**defaults, **config}),
        loss or LeaveOneOut(),
        seed=seed,
        clock=clock or FakeClock(),
    )


def held_ids(buffer: ReplayBuffer) -> list[str]:
    """The problem ids held (by sampling them all: counts one use each)."""
    rollouts, _ = buffer.sample(len(buffer))
    return sorted(r.problem_id for r in rollouts)


def test_rollouts_older_than_the_step_limit_are_dropped_at_ingestion_and_later():
    buffer = make_buffer(max_rollout_step_delay=1)
    g = group(rollout("s3", 1.0, step=3), rollout("s4", 2.0, step=4), rollout("s5", 6.0, step=5))
    buffer.add_batches([batch(g)], current_step=5)
    assert len(buffer) == 2  # step 3 < 5 - 1
    assert buffer.metrics(reset=False)["dropped_stale_step"] == 1

    buffer.set_current_step(6)
    assert len(buffer) == 1  # step 4 < 6 - 1 now
    rollouts, advantages = buffer.sample(1)
    assert rollouts[0].problem_id == "s5"
    # Advantages were computed over the whole group of three, before the stale ones went.
    assert advantages.tolist() == [6.0 - (1.0 + 2.0) / 2]
    assert buffer.metrics()["math/dropped_stale_step"] == 2


def test_rollouts_older_than_the_time_limit_are_dropped_at_ingestion_and_later():
    clock = FakeClock()
    buffer = make_buffer(clock=clock, max_rollout_timestamp_delay=60.0, max_samples_per_rollout=99)
    g = group(rollout("old", age=61.0), rollout("fresh", age=10.0), rollout("edge", age=60.0))
    buffer.add_batches([batch(g)], current_step=0)
    assert held_ids(buffer) == ["edge", "fresh"]

    clock.now += 5.0  # "edge" is now 65 s old, "fresh" 15 s
    buffer.set_current_step(0)
    assert held_ids(buffer) == ["fresh"]
    assert buffer.metrics()["dropped_stale_time"] == 2


def test_sampling_skips_rollouts_that_aged_out_since_the_last_step():
    clock = FakeClock()
    buffer = make_buffer(clock=clock, max_rollout_timestamp_delay=60.0)
    buffer.add_batches(
        [batch(group(rollout("a", age=50.0), rollout("b", age=0.0)))], current_step=0
    )
    clock.now += 20.0
    assert buffer.sample(2) is None
    assert [r.problem_id for r in buffer.sample(1)[0]] == ["b"]


def test_rollouts_without_metadata_are_refused_and_nothing_is_added():
    buffer = make_buffer()
    bare = Rollout.single_turn(
        env_name="math",
        lesson_id="l",
        problem_id="p7",
        prompt_tokens=[1],
        response_tokens=[2],
        response_logprobs=[-1.0],
        reward=1.0,
    )
    good = batch(group(rollout("ok")))
    with pytest.raises(ValueError, match="problem 'p7'.* has no metadata.*RolloutMetadata"):
        buffer.add_batches([good, batch(group(rollout("ok2"), bare))], current_step=0)
    assert len(buffer) == 0


def test_rollouts_dropped_before_any_use_are_counted_for_the_worker_that_made_them():
    """A paced rollout worker asks for this count and generates those rollouts again."""
    buffer = make_buffer(max_rollout_step_delay=1, capacity=3)
    made_by_w = [rollout("w0", 1.0, step=0), rollout("w1", 0.0, step=0)]
    buffer.add_batches([batch(group(*made_by_w))], current_step=0)
    buffer.sample(1)  # one of the two is trained on
    other = rollout("x", step=2, worker="x")
    buffer.add_batches([batch(group(rollout("late", step=0), other))], current_step=2)
    # At step 2 the step-0 rollouts are stale: the unused one and "late" (stale on arrival)
    # count, the used one does not, and nothing of worker "x" was dropped.
    assert buffer.unused_dropped("w") == 2
    assert buffer.unused_dropped("x") == 0
    for k in range(4):  # capacity 3: evicting unused rollouts counts too (the oldest: x, e0)
        buffer.add_batches([batch(group(rollout(f"e{k}", step=2)))], current_step=2)
    assert held_ids(buffer) == ["e1", "e2", "e3"]
    assert (buffer.unused_dropped("w"), buffer.unused_dropped("x")) == (2 + 1, 1)


def test_capacity_evicts_the_oldest_rollouts():
    buffer = make_buffer(capacity=5, max_samples_per_rollout=2)
    for k in range(3):
        buffer.add_batches([batch(group(rollout(f"{k}a"), rollout(f"{k}b")))], current_step=0)
    assert len(buffer) == 5
    assert held_ids(buffer) == ["0b", "1a", "1b", "2a", "2b"]
    assert buffer.metrics()["evicted"] == 1


def test_a_rollout_is_removed_after_its_reuse_limit():
    buffer = make_buffer(max_samples_per_rollout=2)
    buffer.add_batches(
        [batch(group(rollout("a"), rollout("b")), group(rollout("c")))], current_step=0
    )
    first, _ = buffer.sample(3)
    second, _ = buffer.sample(3)
    assert {r.problem_id for r in first} == {r.problem_id for r in second} == {"a", "b", "c"}
    assert buffer.sample(1) is None and len(buffer) == 0

    once = make_buffer(max_samples_per_rollout=1)
    once.add_batches(
        [batch(group(rollout("a"), rollout("b")), group(rollout("c")))], current_step=0
    )
    taken = [r.problem_id for _ in range(3) for r in once.sample(1)[0]]
    assert sorted(taken) == ["a", "b", "c"]  # each used once, then gone
    assert once.sample(1) is None


def test_recency_weighting_prefers_newer_groups():
    def newest_half_share(alpha: float) -> float:
        buffer = make_buffer(recency_alpha=alpha, max_samples_per_rollout=10**6, seed=1)
        for k in range(20):  # group k is the k-th oldest
            g = group(rollout(f"{k:02d}-0", 0.0), rollout(f"{k:02d}-1", 1.0))
            buffer.add_batches([batch(g)], current_step=0)
        picks = []
        for _ in range(2000):
            rollouts, _ = buffer.sample(2)
            ids = {r.problem_id.split("-")[0] for r in rollouts}
            assert len(ids) == 1  # one whole group
            picks.append(int(ids.pop()))
        return float(np.mean(np.asarray(picks) >= 10))

    # Expected shares: 0.5 uniformly; sum_{11..20} j^3 / sum_{1..20} j^3 = 0.93 with alpha=3.
    assert 0.45 < newest_half_share(0.0) < 0.55
    assert newest_half_share(3.0) > 0.9


def test_groups_without_a_gradient_only_fill_what_informative_groups_leave():
    """Dynamic sampling: a group whose rewards are all equal has all-zero advantages."""

    def mixed(seed, weight):
        buffer = make_buffer(seed=seed, uninformative_group_weight=weight)
        informative = [group(rollout(f"i{k}", 1.0), rollout(f"i{k}", 0.0)) for k in range(3)]
        flat = [group(rollout(f"z{k}", 1.0), rollout(f"z{k}", 1.0)) for k in range(5)]
        buffer.add_batches([batch(*informative, *flat)], current_step=0)
        return buffer

    for seed in range(20):
        rollouts, advantages = mixed(seed, 0.0).sample(8)
        ids = [r.problem_id for r in rollouts]
        assert sorted(set(ids[:6])) == ["i0", "i1", "i2"]  # every informative group first
        assert all(i.startswith("z") for i in ids[6:])  # then filled from the others
        assert np.count_nonzero(advantages) == 6
    # Weight 1 treats them alike: some batch of 4 (2 groups) holds an uninformative group.
    batches = [mixed(seed, 1.0).sample(4)[0] for seed in range(20)]
    assert any(r.problem_id.startswith("z") for b in batches for r in b)


@pytest.mark.parametrize("seed", range(5))
def test_unequal_groups_give_exactly_n_rollouts_mostly_whole_groups(seed):
    loss = LeaveOneOut()
    buffer = make_buffer(loss=loss, seed=seed, max_samples_per_rollout=10)
    sizes = [3, 1, 4, 2]
    groups = [
        group(*(rollout(f"g{g}-{i}", float(i * i + g)) for i in range(s)))
        for g, s in enumerate(sizes)
    ]
    buffer.add_batches([batch(*groups[:2]), batch(*groups[2:])], current_step=0)
    expected = {
        r.problem_id: a
        for g in groups
        for r, a in zip(g.rollouts, LeaveOneOut().compute_advantages(g), strict=True)
    }
    for n in (5, 7, 10):
        rollouts, advantages = buffer.sample(n)
        ids = [r.problem_id for r in rollouts]
        assert len(ids) == n == len(set(ids)) and advantages.dtype == np.float32
        assert advantages.tolist() == [expected[i] for i in ids]
        per_group = Counter(i.split("-")[0] for i in ids)
        partial = [g for g, c in per_group.items() if c != sizes[int(g[1:])]]
        assert len(partial) <= 1
        runs = [k for k, _ in itertools.groupby(i.split("-")[0] for i in ids)]
        assert len(runs) == len(per_group)  # each group's rollouts are adjacent
    assert buffer.sample(11) is None


def test_empty_batches_and_empty_groups_are_fine():
    loss = LeaveOneOut()
    buffer = make_buffer(loss=loss)
    buffer.add_batches([], current_step=0)
    buffer.add_batches([batch(), batch(group(), group(rollout("a")), group())], current_step=1)
    assert len(buffer) == 1 and loss.groups_seen == 1
    assert buffer.sample(2) is None
    assert len(buffer) == 1  # a failed sample changes nothing


def test_a_loss_returning_the_wrong_number_of_advantages_is_reported():
    class Broken(LeaveOneOut):
        def compute_advantages(self, group):
            return np.zeros(1, np.float32)

    buffer = make_buffer(loss=Broken())
    with pytest.raises(ValueError, match="returned 1 advantages for a group of 2"):
        buffer.add_batches([batch(group(rollout("a"), rollout("b")))], current_step=0)


def test_metrics_on_a_hand_built_example():
    clock = FakeClock()
    buffer = make_buffer(clock=clock, max_rollout_step_delay=1, max_rollout_timestamp_delay=100.0)
    math_group = group(
        rollout("m1", 1.0, step=5),
        rollout("m2", 0.0, step=4, truncated=True),
    )
    code_group = group(
        rollout("c1", 0.5, env="code", step=5, n_prompt=4, n_response=1),
        rollout("c2", 0.5, env="code", step=2, n_prompt=4, n_response=1),  # stale by step
    )
    old_group = group(rollout("m3", 2.0, step=5, age=500.0))  # stale by time
    buffer.add_batches([batch(math_group, code_group), batch(old_group)], current_step=5)

    m = buffer.metrics()
    expected = {
        "math/rollouts_in_buffer": 2,
        "math/tokens_in_buffer": 10,
        "math/frac_on_policy": 0.5,
        "math/new_rollouts": 2,
        "math/new_tokens": 10,
        "math/new_generated_tokens": 6,
        "math/reward/mean": 0.5,
        "math/reward/std": 0.5,
        "math/frac_truncated": 0.5,
        "math/dropped_stale_step": 0,
        "math/dropped_stale_time": 1,
        "math/frac_zero_variance_groups": 0.5,
        "math/frac_used": 0.0,
        "code/rollouts_in_buffer": 1,
        "code/tokens_in_buffer": 5,
        "code/frac_on_policy": 1.0,
        "code/new_rollouts": 1,
        "code/new_generated_tokens": 1,
        "code/reward/mean": 0.5,
        "code/reward/std": 0.0,
        "code/dropped_stale_step": 1,
        "code/frac_zero_variance_groups": 1.0,
        "rollouts_in_buffer": 3,
        "tokens_in_buffer": 15,
        "frac_on_policy": 2 / 3,
        "new_rollouts": 3,
        "new_tokens": 15,
        "new_generated_tokens": 7,
        "reward/mean": 0.5,
        "reward/std": np.std([1.0, 0.0, 0.5]),
        "frac_truncated": 1 / 3,
        "dropped_stale_step": 1,
        "dropped_stale_time": 1,
        "frac_zero_variance_groups": 2 / 3,
        "frac_used": 0.0,
        "evicted": 0,
        "sampled_rollouts": 0,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key

    buffer.sample(2)
    m = buffer.metrics()
    assert m["new_rollouts"] == 0 and "reward/mean" not in m  # window was reset
    assert m["sampled_rollouts"] == 2
    assert m["frac_used"] == pytest.approx(2 / 3)
    assert m["rollouts_in_buffer"] == 1  # max_samples_per_rollout=1: used ones left


def test_bad_config_values_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        make_buffer(capacity=0)
    with pytest.raises(ValueError, match="max_samples_per_rollout"):
        make_buffer(max_samples_per_rollout=0)


def test_a_restored_buffer_samples_exactly_as_the_saved_one_would():
    """A checkpoint keeps the held rollouts, their advantages, groups and uses, and the
    sampling RNG: a resumed run draws the batches the uninterrupted one would have drawn."""
    import json

    saved = make_buffer(recency_alpha=3.0, max_samples_per_rollout=2, seed=7)
    for k in range(6):
        saved.add_batches(
            [batch(group(*(rollout(f"g{k}r{i}", float(i == k % 3), step=k) for i in range(4))))],
            current_step=k,
        )
    saved.sample(5)  # some rollouts used once already
    data, state = saved.state_dict()
    state = json.loads(json.dumps(state))  # what state.json holds

    restored = make_buffer(recency_alpha=3.0, max_samples_per_rollout=2, seed=123)
    restored.load_state_dict(data, state)
    assert len(restored) == len(saved)
    for _ in range(4):
        a, b = saved.sample(5), restored.sample(5)
        assert [r.problem_id for r in a[0]] == [r.problem_id for r in b[0]]
        assert a[1].tolist() == b[1].tolist()
    assert restored.metrics(reset=False)["rollouts_in_buffer"] == len(saved)

    with pytest.raises(ValueError, match="lists 1 rollouts"):
        make_buffer().load_state_dict(data, {**state, "advantages": [0.0]})


def test_time_the_job_was_down_does_not_age_restored_rollouts():
    """A preempted job that waits two hours in a queue resumes with its buffer: only the time
    it ran counts towards max_rollout_timestamp_delay (the whole buffer was dropped, and its
    batches are never generated again)."""
    clock = FakeClock()
    saved = make_buffer(clock=clock, max_rollout_timestamp_delay=3600.0)
    saved.add_batches(
        [batch(group(rollout("a", age=3000.0), rollout("b", age=0.0)))], current_step=0
    )
    data, state = saved.state_dict()
    clock.now += 7200.0  # down for two hours
    restored = make_buffer(
        clock=clock, max_rollout_timestamp_delay=3600.0, max_samples_per_rollout=99
    )
    restored.load_state_dict(data, state)
    restored.set_current_step(0)
    assert held_ids(restored) == ["a", "b"]
    clock.now += 601.0  # "a" has now run 3601 s since it was made
    restored.set_current_step(0)
    assert held_ids(restored) == ["b"]


# --- batching by env -------------------------------------------------------------------------


def _env_groups(env: str, count: int, *, size: int = 4, n_response: int = 3) -> list[RolloutGroup]:
    return [
        group(
            *(
                rollout(f"{env}{g}", float(i % 2), env=env, n_response=n_response)
                for i in range(size)
            )
        )
        for g in range(count)
    ]


def test_batches_follow_each_envs_token_share():
    # "short" rollouts have 5 tokens, "long" ones 20: by rollouts the buffer is even, by tokens
    # mostly "long". Asked for 70% short tokens, a batch takes far more short rollouts.
    buffer = make_buffer(env_token_fractions={"short": 0.7, "long": 0.3})
    buffer.add_batches(
        [batch(*_env_groups("short", 12, n_response=3), *_env_groups("long", 12, n_response=18))],
        current_step=0,
    )
    rollouts, _ = buffer.sample(32)
    tokens = Counter()
    for r in rollouts:
        tokens[r.env_name] += r.num_tokens
    share = tokens["short"] / (tokens["short"] + tokens["long"])
    assert 0.6 <= share <= 0.8, tokens
    metrics = buffer.metrics()
    assert metrics["short/frac_sampled_tokens"] == pytest.approx(share)
    assert metrics["short/sampled_tokens"] == tokens["short"]

    # Unnamed envs share what the named ones leave; with one env waiting, it fills the batch.
    alone = make_buffer(env_token_fractions={"short": 0.7})
    alone.add_batches([batch(*_env_groups("long", 8))], current_step=0)
    assert {r.env_name for r in alone.sample(16)[0]} == {"long"}


def test_groups_below_the_minimum_size_are_not_sampled():
    buffer = make_buffer(min_group_size=3)
    buffer.add_batches(
        [
            batch(
                *_env_groups("math", 2, size=4), group(rollout("small", 1.0), rollout("small", 0.0))
            )
        ],
        current_step=0,
    )
    assert len(buffer) == 10
    rollouts, _ = buffer.sample(8)
    assert "small" not in {r.problem_id for r in rollouts}
    assert buffer.sample(2) is None  # only the 2-rollout group is left


def test_rollouts_the_loss_gives_no_advantage_are_dropped_and_made_again():
    """A NaN advantage (grpo/rloo with drop_zero_variance_groups) keeps a group out of every
    batch; it counts as dropped unused, so a paced worker generates as many again."""
    from marin_rl_plugins.grpo import GRPOConfig, GRPOLoss

    buffer = make_buffer(loss=GRPOLoss(GRPOConfig(drop_zero_variance_groups=True)))
    flat = group(rollout("a", 1.0), rollout("b", 1.0))
    varied = group(rollout("c", 1.0), rollout("d", 0.0))
    buffer.add_batches([batch(flat, varied)], current_step=0)
    assert held_ids(buffer) == ["c", "d"]
    metrics = buffer.metrics()
    assert metrics["dropped_by_loss"] == 2 and metrics["frac_zero_variance_groups"] == 0.5
    assert buffer.unused_dropped("w") == 2
