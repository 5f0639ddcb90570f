"""The loss contract (issue 26): per-token losses weighed once over the whole step, the same
however the step is cut, and the policy-gradient objective's options against plain numpy."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from marin_rl_plugins.grpo import GRPOConfig, GRPOLoss, grpo_advantages

from marin_rl_core import Rollout, RolloutGroup, build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.learner.loss import aggregate, as_named, reward_to_go, sequence_mean
from marin_rl_core.learner.policy_gradient import PolicyGradientConfig, policy_gradient_loss
from marin_rl_core.learner.step import Learner, plugin_loss_fn
from marin_rl_core.learner.training_batch import training_batch_from_rollouts
from marin_rl_core.models.build import initial_model
from marin_rl_core.models.tokenizer import model_tokenizer

jax.config.update("jax_enable_x64", False)


def rollouts(
    n: int, *, seed: int = 0, max_response: int = 6, lesson: str = "count"
) -> list[Rollout]:
    """``n`` single-turn rollouts with responses of 1..``max_response`` tokens (uneven, so
    micro-batches and rows hold different numbers of response tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 12, size=int(rng.integers(2, 5))).astype(np.int32)
        length = int(rng.integers(1, max_response + 1))
        out.append(
            Rollout.single_turn(
                env_name="mock",
                lesson_id=lesson,
                problem_id=str(i),
                prompt_tokens=prompt,
                response_tokens=rng.integers(3, 12, size=length).astype(np.int32),
                response_logprobs=-rng.uniform(1.0, 3.0, size=length).astype(np.float32),
                reward=float(rng.integers(0, 2)),
            )
        )
    return out


# --- the objective against numpy -----------------------------------------------------------------


def sequences_of(batch) -> np.ndarray:
    """A global rollout id per position (-1 where none)."""
    mask = np.asarray(batch.loss_mask.array)
    rows, width = mask.shape
    if batch.segment_ids is None:
        ids = np.repeat(np.arange(rows)[:, None], width, axis=1)
    else:
        seg = np.asarray(batch.segment_ids.array)
        ids = np.where(seg >= 0, np.arange(rows)[:, None] * width + seg, -1)
    return np.where(mask > 0, ids, -1)


def reference_weights(mask: np.ndarray, seq: np.ndarray, aggregation: str, length: int):
    if aggregation == "token_mean":
        return mask / mask.sum()
    ids = np.unique(seq[seq >= 0])
    counts = {i: mask[seq == i].sum() for i in ids}
    out = np.zeros_like(mask)
    for i in ids:
        out[seq == i] = 1.0 / (len(ids) * (counts[i] if aggregation == "sequence_mean" else length))
    return out


def reference_objective(c: PolicyGradientConfig, batch, logp, ent, ref, length):
    """The loss value and its gradients in logp and entropy, written out by hand (the
    stop-gradients of the formulas in policy_gradient's docstring taken literally)."""
    mask = np.asarray(batch.loss_mask.array, np.float64)
    b = np.asarray(batch.behaviour_logprobs.array, np.float64)
    adv = np.asarray(batch.advantages.array, np.float64)
    seq = sequences_of(batch)
    logp, ent = logp.astype(np.float64), ent.astype(np.float64)

    def per_sequence(values, how):
        out = np.zeros_like(values)
        for i in np.unique(seq[seq >= 0]):
            at = np.flatnonzero(seq.reshape(-1) == i)
            v = values.reshape(-1)[at]
            if how == "mean":
                out.reshape(-1)[at] = v.mean()
            else:  # suffix sums in position order
                out.reshape(-1)[at] = np.cumsum(v[::-1])[::-1]
        return out

    k = dk = 0.0
    if c.kl_coef > 0:
        d = logp - ref
        k, dk = {
            "k1": (d, np.ones_like(d)),
            "k2": (0.5 * d * d, d),
            "k3": (np.exp(-d) + d - 1, 1 - np.exp(-d)),
        }[c.kl_estimator]
        if c.kl_in == "reward":
            adv = adv - c.kl_coef * per_sequence(k, "suffix")
    w = np.minimum(np.exp(logp - b), c.tis_cap) if c.tis_cap else np.ones_like(logp)
    old = logp if c.tis_cap else b
    log_ratio = logp - old
    if c.ratio == "sequence":
        log_ratio = per_sequence(log_ratio, "mean")
    r = np.exp(log_ratio)
    bounded = np.clip(r, 1 - c.clip_low, 1 + c.clip_high)
    if c.objective == "clip":
        un, cl = r * adv, bounded * adv
        o = np.minimum(un, cl)
        do = np.where(un <= cl, r * adv, 0.0)
        if c.dual_clip:
            floored = (adv < 0) & (o < c.dual_clip * adv)
            o = np.where(floored, c.dual_clip * adv, o)
            do = np.where(floored, 0.0, do)
    else:
        o, do = bounded * adv * logp, bounded * adv
    loss = -w * o - c.entropy_coef * ent
    dloss = -w * do
    if c.kl_coef > 0 and c.kl_in == "loss":
        loss, dloss = loss + c.kl_coef * k, dloss + c.kl_coef * dk
    weights = reference_weights(mask, seq, c.aggregation, length)
    return (weights * loss).sum(), weights * dloss, -c.entropy_coef * weights


CASES = {
    "ppo clip": {},
    "clip higher": {"clip_high": 0.28},
    "dual clip": {"dual_clip": 1.5, "clip_low": 0.1},
    "gspo": {"ratio": "sequence", "clip_low": 0.05, "clip_high": 0.05,
             "aggregation": "sequence_mean"},
    "cispo": {"objective": "cispo", "clip_low": 1.0, "clip_high": 0.1},
    "tis": {"tis_cap": 1.5},
    "k1 in loss": {"kl_coef": 0.1, "kl_estimator": "k1"},
    "k2 in loss": {"kl_coef": 0.1, "kl_estimator": "k2"},
    "k3 in loss, entropy": {"kl_coef": 0.1, "entropy_coef": 0.01},
    "k3 in reward": {"kl_coef": 0.5, "kl_in": "reward"},
    "sequence mean": {"aggregation": "sequence_mean"},
    "dr grpo": {"aggregation": "sum_over_length", "aggregation_length": 8},
}  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_objective_and_its_gradients_match_numpy(case, packed):
    c = PolicyGradientConfig(**CASES[case])
    rs = rollouts(8, seed=1)
    advantages = np.random.default_rng(2).normal(size=len(rs)).astype(np.float32)
    batch = training_batch_from_rollouts(
        rs, advantages, 16, 0, batch_size=8, pack=packed,
        aggregation=(c.aggregation, c.aggregation_length),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    shape = batch.loss_mask.array.shape
    # The policy near the sampler (some ratios clip, most do not), the reference further off.
    logp = np.asarray(batch.behaviour_logprobs.array) + rng.normal(scale=0.15, size=shape)
    ent = rng.uniform(0.5, 2.0, size=shape)
    ref = logp + rng.normal(scale=0.5, size=shape)
    logp, ent, ref = (x.astype(np.float32) for x in (logp, ent, ref))

    def value(lp, en):
        return aggregate(policy_gradient_loss(c, batch, lp, en, jnp.asarray(ref)), batch)[0]

    got, (g_logp, g_ent) = jax.value_and_grad(value, argnums=(0, 1))(
        jnp.asarray(logp), jnp.asarray(ent)
    )
    want, want_logp, want_ent = reference_objective(c, batch, logp, ent, ref, 8)
    assert float(got) == pytest.approx(want, rel=2e-4, abs=1e-6)
    np.testing.assert_allclose(np.asarray(g_logp), want_logp, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_ent), want_ent, rtol=1e-4, atol=1e-8)
    assert np.abs(want_logp).sum() > 0


def test_sequence_helpers_keep_packed_rollouts_apart():
    rs = rollouts(6, seed=4)
    batch = training_batch_from_rollouts(rs, np.zeros(6), 24, 0, batch_size=6, pack=True)
    mask = np.asarray(batch.loss_mask.array)
    seg = batch.segment_ids.array
    assert (np.asarray(seg).max(axis=1) > 0).any(), "the fixture should pack rollouts together"
    values = np.random.default_rng(5).normal(size=mask.shape).astype(np.float32)
    seq = sequences_of(batch)
    means = np.asarray(sequence_mean(jnp.asarray(values), jnp.asarray(mask), seg))
    suffix = np.asarray(reward_to_go(jnp.asarray(values), jnp.asarray(mask), seg))
    for i in np.unique(seq[seq >= 0]):
        at = seq == i
        np.testing.assert_allclose(means[at], values[at].mean(), rtol=1e-5)
        np.testing.assert_allclose(suffix[at], np.cumsum(values[at][::-1])[::-1], rtol=1e-5)


# --- one loss however the step is cut ------------------------------------------------------------


def step_loss_and_grad_norm(loss_name: str, *, micro: int, pack: bool, legacy: bool = False):
    """The loss and gradient norm of one optimizer step of the real learner on one fixed batch
    of 8 rollouts, cut into ``8 / micro`` micro-batches."""
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "mock", "loss": loss_name},
        overrides=["trainer.batch_size=8", f"trainer.microbatch_size={micro}",
                   "model.max_seq_len=16", "loss.kl_coef=0.05"],
    )  # fmt: skip
    tok = model_tokenizer(config.model)
    model = initial_model(config, tok)
    learner = Learner(config.trainer)
    module = registry.get("loss", loss_name).build(config.loss.config)
    reference = learner.shard(jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model))
    loss_fn = plugin_loss_fn(module)
    if legacy:  # the contract before issue 26: a loss normalised within each micro-batch

        def loss_fn(model, batch, *, key=None, reference=None):
            out = module.create_loss_fn(reference, model)(model, batch, key=key)
            mask = batch.loss_mask.array
            per_token = jnp.where(mask > 0, out.loss.array, 0.0)
            return jnp.sum(per_token) / jnp.maximum(jnp.sum(mask), 1.0), {}

    learner.set_loss(loss_fn, reference=reference)
    state = learner.init_state(model, key=jax.random.PRNGKey(0))
    rs = rollouts(8, seed=6, max_response=8)
    advantages = np.linspace(-1.0, 1.0, 8)
    batch = training_batch_from_rollouts(
        rs, advantages, 16, tok.pad_id, batch_size=8, pack=pack, row_multiple=micro,
        aggregation=module.plan.aggregation,
    )  # fmt: skip
    _, loss, metrics = learner.step(state, batch)
    return loss, metrics["grad_norm"], metrics


@pytest.mark.parametrize("loss_name", ["rloo", pytest.param("grpo", marks=pytest.mark.slow)])
def test_the_same_batch_cut_into_1_2_or_4_micro_batches_packed_or_not_gives_one_loss(loss_name):
    whole, norm, metrics = step_loss_and_grad_norm(loss_name, micro=8, pack=False)
    assert metrics["num_tokens"] > 0 and 0 < metrics["ratio_mean"] < 10
    for micro in (8, 4, 2):
        for pack in (False, True):
            if (micro, pack) == (8, False):
                continue
            loss, grad_norm, cut = step_loss_and_grad_norm(loss_name, micro=micro, pack=pack)
            assert loss == pytest.approx(whole, rel=1e-4, abs=1e-6), (micro, pack)
            assert grad_norm == pytest.approx(norm, rel=1e-3), (micro, pack)
            for name in ("ratio_mean", "entropy", "kl", "num_tokens"):
                assert cut[name] == pytest.approx(metrics[name], rel=1e-4, abs=1e-6), name
    # What the contract replaced: normalised per micro-batch, the loss depends on the cut.
    per_micro = [step_loss_and_grad_norm(loss_name, micro=m, pack=False, legacy=True)[0]
                 for m in (8, 2)]  # fmt: skip
    assert per_micro[0] != pytest.approx(per_micro[1], rel=1e-3)


# --- grpo's advantages ---------------------------------------------------------------------------


def group(rewards, lengths=None) -> RolloutGroup:
    lengths = lengths or [2] * len(rewards)
    return RolloutGroup(
        rollouts=[
            Rollout.single_turn(
                env_name="mock",
                lesson_id="count",
                problem_id="p",
                prompt_tokens=[3, 4],
                response_tokens=[5] * n,
                response_logprobs=[-1.0] * n,
                reward=r,
            )
            for r, n in zip(rewards, lengths, strict=True)
        ]
    )


@pytest.mark.parametrize("norm", ["none", "group_mean", "group_mean_std"])
def test_grpo_advantages_match_numpy(norm):
    r = np.array([1.0, 0.0, 0.5, 0.0])
    want = {
        "none": r,
        "group_mean": r - r.mean(),
        "group_mean_std": (r - r.mean()) / (r.std() + 1e-6),
    }
    np.testing.assert_allclose(grpo_advantages(r, norm), want[norm], rtol=1e-6)
    loss = GRPOLoss(GRPOConfig(advantage_norm=norm))
    np.testing.assert_allclose(loss.compute_advantages(group(list(r))), want[norm], rtol=1e-6)


def test_over_long_responses_lose_reward_and_uninformative_groups_can_be_dropped():
    c = GRPOConfig(advantage_norm="none", overlong_length=10, overlong_buffer=4)
    shaped = GRPOLoss(c).compute_advantages(group([1.0, 1.0, 1.0, 1.0], [6, 7, 9, 12]))
    # Penalty min(1, (n - 6) / 4): 0, 0.25, 0.75, 1.
    np.testing.assert_allclose(shaped, [1.0, 0.75, 0.25, 0.0], rtol=1e-6)
    dropping = GRPOLoss(GRPOConfig(drop_zero_variance_groups=True))
    assert np.isnan(dropping.compute_advantages(group([1.0, 1.0]))).all()
    assert np.isfinite(dropping.compute_advantages(group([1.0, 0.0]))).all()
    with pytest.raises(ValueError, match="overlong_buffer"):
        GRPOConfig(overlong_length=10)


# --- GAE -----------------------------------------------------------------------------------------


def gae_loop(rewards, values, mask, seq, gamma, lam):
    """GAE the textbook way: each rollout's actions in order, one Python loop per rollout."""
    advantages = np.zeros_like(values)
    for i in np.unique(seq[seq >= 0]):
        at = list(zip(*np.nonzero((seq == i) & (mask > 0)), strict=True))  # row-major order
        next_value = next_advantage = 0.0
        for t in reversed(at):
            delta = rewards[t] + gamma * next_value - values[t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[t], next_value = next_advantage, values[t]
    return advantages, np.where(mask > 0, advantages + values, 0.0)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_a_loop_over_each_rollouts_actions(gamma, lam, packed):
    from marin_rl_plugins.ppo_critic import gae

    rs = rollouts(6, seed=7)
    batch = training_batch_from_rollouts(rs, np.zeros(6), 24, 0, batch_size=6, pack=packed)
    mask = np.array(batch.loss_mask.array)
    if packed:
        assert (np.asarray(batch.segment_ids.array).max(axis=1) > 0).any()
    # A gap in one rollout's actions, as a multi-turn rollout's observations make.
    first = np.flatnonzero(mask[0])
    mask[0, first[1]] = 0.0 if len(first) > 2 else mask[0, first[1]]
    rng = np.random.default_rng(8)
    rewards = np.where(mask > 0, rng.normal(size=mask.shape), 0.0).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    seg = batch.segment_ids.array if packed else None
    got_a, got_r = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), seg,
                       gamma=gamma, lam=lam)  # fmt: skip
    seq = np.where(mask > 0, sequences_of(batch), -1)
    want_a, want_r = gae_loop(rewards, values, mask, seq, gamma, lam)
    np.testing.assert_allclose(np.asarray(got_a), want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_r), want_r, rtol=1e-5, atol=1e-5)


# --- ppo -----------------------------------------------------------------------------------------


def tiny_policy():
    from marin_rl_core.config import ModelConfig
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    config = ModelConfig(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, max_seq_len=24)  # fmt: skip
    return build_model(config, ArithmeticTokenizer(), key=jax.random.PRNGKey(0))


def rewarded_batch(packed: bool, aggregation, *, seed: int = 9):
    rs = rollouts(6, seed=seed)
    return training_batch_from_rollouts(
        rs, np.zeros(6), 24, 0, batch_size=6, pack=packed, aggregation=aggregation,
        token_rewards=True,
    )  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("critic", ["head", "model"])
def test_ppo_is_the_objective_on_gae_advantages_plus_the_value_loss(critic, packed):
    from marin_rl_plugins.ppo import PPOConfig, PPOLoss

    from marin_rl_core.learner.loss import TrainedModel, step_loss
    from marin_rl_core.learner.training_batch import (
        batch_hidden_states,
        batch_logprobs_and_entropy,
    )

    config = PPOConfig(kl_coef=0.0, gamma=0.9, lam=0.8, vf_coef=0.5, critic=critic)
    loss = PPOLoss(config)
    policy = tiny_policy()
    state = loss.plan.init_state(policy, key=jax.random.PRNGKey(1))
    # A critic that is not all zeros, so values, GAE and the value loss all matter.
    head = eqx.tree_at(lambda h: (h.weight, h.bias), state.head,
                       (state.head.weight + 0.3, state.head.bias + 0.2))  # fmt: skip
    model = TrainedModel(policy=policy, loss_state=eqx.tree_at(lambda s: s.head, state, head))
    batch = rewarded_batch(packed, loss.plan.aggregation)
    got, metrics = step_loss(loss.create_loss_fn(None, model), model, batch)

    logp, ent, hidden = batch_logprobs_and_entropy(policy, batch, with_hidden=True)
    if critic == "model":
        hidden = batch_hidden_states(model.loss_state.trunk, batch)
    h = np.asarray(hidden.array, np.float64)
    values = h @ np.asarray(head.weight.array, np.float64) + float(head.bias)
    mask = np.asarray(batch.loss_mask.array, np.float64)
    seq = sequences_of(batch)
    rewards = np.asarray(batch.token_rewards.array, np.float64)
    assert rewards.sum() > 0, "the fixture should have some reward"
    advantages, returns = gae_loop(rewards, values, mask, seq, config.gamma, config.lam)
    gae_batch = eqx.tree_at(
        lambda b: b.advantages,
        batch,
        as_named(jnp.asarray(advantages, jnp.float32), batch.advantages),
    )
    policy_part, _, _ = reference_objective(
        config, gae_batch, np.asarray(logp.array), np.asarray(ent.array), None, 24
    )
    weights = reference_weights(mask, seq, config.aggregation, 24)
    value_part = (weights * 0.5 * (values - returns) ** 2).sum()
    assert float(got) == pytest.approx(policy_part + config.vf_coef * value_part, rel=1e-4)
    assert float(metrics["value_loss"]) == pytest.approx(
        (mask * 0.5 * (values - returns) ** 2).sum() / mask.sum(), rel=1e-4
    )
    assert float(metrics["vf_clipfrac"]) == 0.0  # one update per batch: V_old is V


def moved_critic(model, by: float):
    head = model.loss_state.head
    head = eqx.tree_at(lambda h: (h.weight, h.bias), head, (head.weight + by, head.bias + by))
    return eqx.tree_at(lambda m: m.loss_state.head, model, head)


def numpy_values(model, batch) -> np.ndarray:
    from marin_rl_core.learner.training_batch import batch_hidden_states

    head = model.loss_state.head
    h = np.asarray(batch_hidden_states(model.policy, batch).array, np.float64)
    return h @ np.asarray(head.weight.array, np.float64) + float(head.bias)


def test_ppo_with_several_updates_prepares_old_values_and_whitens_over_the_whole_step():
    """With epochs x minibatches, values, GAE and the whitening are computed once before the
    step's updates, over all its minibatches; the value loss then clips to those old values."""
    from marin_rl_plugins.ppo import PPOConfig, PPOLoss

    from marin_rl_core.learner.loss import TrainedModel, step_loss

    config = PPOConfig(kl_coef=0.0, gamma=0.9, lam=0.8, vf_coef=0.5, vf_clip=0.05,
                       epochs=2, minibatches=2, normalize_advantages=True)  # fmt: skip
    loss = PPOLoss(config)
    policy = tiny_policy()
    model = TrainedModel(policy=policy, loss_state=loss.plan.init_state(policy, key=None))
    model = moved_critic(model, 0.3)
    batches = (
        rewarded_batch(False, loss.plan.aggregation),
        rewarded_batch(True, loss.plan.aggregation, seed=4),
    )
    prepared = loss.plan.create_prepare_fn(None, model)(model, batches)

    found = []
    for batch in batches:
        values = numpy_values(model, batch)
        mask = np.asarray(batch.loss_mask.array, np.float64)
        rewards = np.asarray(batch.token_rewards.array, np.float64)
        adv, ret = gae_loop(rewards, values, mask, sequences_of(batch), config.gamma, config.lam)
        found.append((values, adv, ret, mask))
    every = np.concatenate([a[m > 0] for _, a, _, m in found])
    for (values, adv, ret, mask), out in zip(found, prepared, strict=True):
        at = mask > 0
        np.testing.assert_allclose(
            np.asarray(out["values"].array)[at], values[at], rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(
            np.asarray(out["returns"].array)[at], ret[at], rtol=1e-4, atol=1e-5
        )
        whitened = (adv - every.mean()) / (every.std() + 1e-8)
        np.testing.assert_allclose(
            np.asarray(out["advantages"].array)[at], whitened[at], rtol=1e-3, atol=1e-4
        )
    assert (
        abs(
            np.mean(
                [
                    np.asarray(o["advantages"].array)[f[3] > 0].mean()
                    for o, f in zip(prepared, found)
                ]
            )
        )
        < 0.5
    )

    # After an update moved the critic, the value loss clips to the values before the step.
    batch = eqx.tree_at(
        lambda b: b.prepared, batches[0], dict(prepared[0]), is_leaf=lambda x: x is None
    )
    moved = moved_critic(model, -0.2)
    _, metrics = step_loss(loss.create_loss_fn(None, moved), moved, batch)
    values, _, ret, mask = found[0]
    new = numpy_values(moved, batch)
    clipped = values + np.clip(new - values, -config.vf_clip, config.vf_clip)
    per_token = 0.5 * np.maximum((new - ret) ** 2, (clipped - ret) ** 2)
    assert float(metrics["value_loss"]) == pytest.approx(
        (mask * per_token).sum() / mask.sum(), rel=1e-3
    )
    clip_binds = (mask * ((clipped - ret) ** 2 > (new - ret) ** 2)).sum() / mask.sum()
    assert 0 < float(metrics["vf_clipfrac"]) == pytest.approx(clip_binds)


def test_a_ppo_trainer_step_makes_epochs_x_minibatches_updates_after_value_pretraining(tmp_path):
    """Through the trainer: a step of 2 epochs x 2 minibatches is 4 optimizer updates; the
    first ``value_pretrain_steps`` steps move the critic and leave the policy as it was."""
    from marin_rl_core.learner.loss import policy_of
    from marin_rl_core.learner.trainer import Trainer

    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "mock", "loss": "ppo"},
        overrides=["trainer.batch_size=8", "sampling.n_generations_per_prompt=2",
                   "model.max_seq_len=24", "loss.kl_coef=0.0", "loss.epochs=2",
                   "loss.minibatches=2", "loss.value_pretrain_steps=1", "loss.vf_clip=0.01",
                   "loss.critic_learning_rate=0.05", "trainer.warmup_steps=0"],
    )  # fmt: skip
    trainer = Trainer(config, registry, run_dir=tmp_path, storage=None)
    rs = rollouts(8, seed=3, lesson="mock")

    def weights():
        model = trainer.state.model
        return (np.asarray(policy_of(model).embeddings.token_embeddings.weight.array).copy(),
                np.asarray(model.loss_state.head.weight.array).copy())  # fmt: skip

    policy0, critic0 = weights()
    first = trainer.train_one_step(rs, np.zeros(8, np.float32))
    policy1, critic1 = weights()
    assert int(trainer.state.step) == 4  # levanter counts optimizer updates
    np.testing.assert_array_equal(policy1, policy0)
    assert np.abs(critic1 - critic0).max() > 0
    responses = sum(len(r.response_tokens) for r in rs)
    assert first["num_tokens"] == responses  # counted once per pass over the batch
    assert first["vf_clipfrac"] > 0  # the critic moved past vf_clip within the step
    trainer.train_one_step(rs, np.zeros(8, np.float32))
    assert int(trainer.state.step) == 8
    assert np.abs(weights()[0] - policy1).max() > 0


def test_minibatches_must_divide_the_batch_and_value_pretraining_must_end():
    from marin_rl_core.errors import ConfigError

    def job(*overrides):
        return resolve_config(
            build_registry(), selections={"env": "mock", "loss": "ppo"},
            overrides=["trainer.batch_size=8", "sampling.n_generations_per_prompt=2",
                       "trainer.num_train_steps=10", *overrides],
        )  # fmt: skip

    with pytest.raises(ConfigError, match=r"\$\.loss\.minibatches: 3 minibatches cannot split"):
        job("loss.minibatches=3")
    with pytest.raises(
        ConfigError, match=r"\$\.trainer\.microbatch_size: 4 does not divide a minibatch of 2"
    ):
        job("loss.minibatches=4", "trainer.microbatch_size=4")
    with pytest.raises(ConfigError, match=r"\$\.loss\.value_pretrain_steps: 10 steps"):
        job("loss.value_pretrain_steps=10")
    job("loss.minibatches=4", "loss.epochs=3", "loss.value_pretrain_steps=9")


def test_a_ppo_checkpoint_restores_the_critic_and_its_optimizer_state_exactly(tmp_path):
    """The critic trains with the policy, is saved with it and comes back whole; only the
    policy is what rollout workers and exports see."""
    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner.checkpoint import load_model, save_checkpoint
    from marin_rl_core.learner.loss import TrainedModel, policy_of

    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "mock", "loss": "ppo"},
        overrides=["trainer.batch_size=6", "sampling.n_generations_per_prompt=2",
                   "model.max_seq_len=24", "loss.kl_coef=0.0",
                   "loss.critic_learning_rate=0.01"],
    )  # fmt: skip
    tok = model_tokenizer(config.model)
    policy = initial_model(config, tok)
    module = registry.get("loss", "ppo").build(config.loss.config)
    model = TrainedModel(
        policy=policy, loss_state=module.plan.init_state(policy, key=jax.random.PRNGKey(1))
    )
    learner = Learner(config.trainer)
    learner.set_loss(plugin_loss_fn(module), state_learning_rate=module.plan.state_learning_rate)
    state = learner.init_state(model, key=jax.random.PRNGKey(0))
    for _ in range(3):
        state, loss, _ = learner.step(state, rewarded_batch(False, module.plan.aggregation))
    head = state.model.loss_state.head
    assert np.abs(np.asarray(head.weight.array)).sum() > 0, "the critic did not train"
    save_checkpoint(tmp_path, 3, trainer_state=state, state={})
    path = next((tmp_path / "checkpoints").glob("step-*"))
    restored = learner.restore(path, learner.state_shapes(model, key=jax.random.PRNGKey(0)))
    saved_leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    restored_leaves = jax.tree.leaves(
        eqx.filter((restored.model, restored.opt_state), eqx.is_array)
    )
    assert len(saved_leaves) == len(restored_leaves)
    for a, b in zip(saved_leaves, restored_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The export's reader sees the policy alone.
    alone = load_model(path, initial_model(config, tok))
    np.testing.assert_array_equal(
        np.asarray(alone.embeddings.token_embeddings.weight.array),
        np.asarray(policy_of(state.model).embeddings.token_embeddings.weight.array),
    )


@pytest.mark.slow
def test_a_stopped_and_resumed_ppo_trainer_matches_an_uninterrupted_one(tmp_path):
    """Four trainer steps of ppo (2 epochs x 2 minibatches, a separate critic model), once
    straight through and once stopped after two and resumed from the checkpoint, on the same
    rollouts: the policy, the critic and the optimizer state end the same."""
    from marin_rl_core.learner.trainer import Trainer

    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "mock", "loss": "ppo"},
        overrides=["trainer.batch_size=8", "sampling.n_generations_per_prompt=2",
                   "model.max_seq_len=24", "loss.kl_coef=0.0", "loss.epochs=2",
                   "loss.minibatches=2", 'loss.critic="model"',
                   "loss.critic_learning_rate=0.01"],
    )  # fmt: skip
    batches = [rollouts(8, seed=10 + i, lesson="mock") for i in range(4)]

    def train(trainer, steps):
        for rs in steps:
            trainer.train_one_step(rs, np.zeros(8, np.float32))

    straight = Trainer(config, registry, run_dir=tmp_path / "straight", storage=None)
    train(straight, batches)
    first = Trainer(config, registry, run_dir=tmp_path / "stopped", storage=None)
    train(first, batches[:2])
    first.checkpoint()
    del first
    resumed = Trainer(config, registry, run_dir=tmp_path / "stopped", storage=None)
    assert resumed.step == 2 and not resumed.resume_warnings
    train(resumed, batches[2:])

    def leaves(t):
        tree = (t.state.step, t.state.model, t.state.opt_state, t.state.training_key)
        return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]

    got, want = leaves(resumed), leaves(straight)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_run_switched_to_or_from_a_loss_with_a_critic_resumes_its_policy(tmp_path, lora_rank):
    """A checkpoint of the policy alone (an ``rloo`` run) resumes under ``ppo``: the policy and
    the step come back, the critic starts fresh and the user is told; and back again. With LoRA
    the checkpoints hold the adapters alone, read onto the base the trainer loaded."""
    from marin_rl_core.learner.loss import TrainedModel, policy_of
    from marin_rl_core.learner.trainer import Trainer

    registry = build_registry()

    def trainer(loss):
        config = resolve_config(
            registry, selections={"env": "mock", "loss": loss},
            overrides=["trainer.batch_size=8", "sampling.n_generations_per_prompt=2",
                       "model.max_seq_len=24", "loss.kl_coef=0.0",
                       f"model.lora.rank={lora_rank}", "trainer.learning_rate=0.01"],
        )  # fmt: skip
        return Trainer(config, registry, run_dir=tmp_path, storage=None)

    def embedding(t):  # what trains: the embeddings, or with LoRA an adapter
        policy = policy_of(t.state.model)
        if lora_rank:
            return np.asarray(
                policy.transformer.layers.stacked.mlp.up_proj.lora.lora_B.weight.array
            )
        return np.asarray(policy.embeddings.token_embeddings.weight.array)

    rs = rollouts(8, seed=3, lesson="mock")
    first = trainer("rloo")
    for _ in range(2):
        first.train_one_step(rs, np.linspace(-1, 1, 8).astype(np.float32))
    first.checkpoint()
    trained = embedding(first)
    assert np.abs(trained).max() > 0

    def base(t):  # with LoRA, frozen and not in the checkpoint: the one the trainer loaded
        return np.asarray(policy_of(t.state.model).embeddings.token_embeddings.weight.array)

    first_base = base(first)
    del first

    ppo = trainer("ppo")
    assert isinstance(ppo.state.model, TrainedModel) and ppo.step == 2
    assert int(ppo.state.step) == 2
    np.testing.assert_array_equal(embedding(ppo), trained)
    if lora_rank:
        np.testing.assert_array_equal(base(ppo), first_base)
    assert not np.asarray(ppo.state.model.loss_state.head.weight.array).any()  # a fresh critic
    assert any("critic) starts fresh" in w for w in ppo.resume_warnings), ppo.resume_warnings
    ppo.train_one_step(rs, np.zeros(8, np.float32))  # trains on from there
    ppo.checkpoint()
    moved = embedding(ppo)
    del ppo

    back = trainer("rloo")
    assert back.step == 3 and not isinstance(back.state.model, TrainedModel)
    np.testing.assert_array_equal(embedding(back), moved)
    assert any("left behind" in w for w in back.resume_warnings), back.resume_warnings
    back.train_one_step(rs, np.linspace(-1, 1, 8).astype(np.float32))


def test_a_ppo_run_trains_its_critic_resumes_and_exports_the_policy(cli, tiny_mock_job, tmp_path):
    """Through ``marinrl run``: the critic is checkpointed beside the policy, a resumed run
    goes on with it, and the export is the policy alone."""
    from marin_rl_core.metrics import read_metrics

    common = [*tiny_mock_job, "--loss", "ppo", "--set", f'run_dir="{tmp_path}"',
              "--set", "trainer.checkpoint_interval_steps=3",
              "--set", "loss.epochs=2", "--set", "loss.minibatches=2"]  # fmt: skip
    first = cli("run", *common, "--set", "trainer.num_train_steps=3", "--run-id", "ppo")
    assert first.exit_code == 0, first.output
    assert (tmp_path / "ppo" / "checkpoints" / "step-000003" / "model" / "loss_state").is_dir()
    again = cli("run", "--resume", str(tmp_path / "ppo"), "--set", "trainer.num_train_steps=5",
                "--set", "loss.epochs=2", "--set", "loss.minibatches=2")  # fmt: skip
    assert again.exit_code == 0, again.output
    train = [r for r in read_metrics(tmp_path / "ppo") if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert all("value_loss" in r and "vf_clipfrac" in r for r in train)
    # Each step's row sums its tokens over one pass of its two minibatches.
    assert all(r["num_tokens"] >= 32 and math.isfinite(r["loss"]) for r in train)
    export = cli("export", str(tmp_path / "ppo"), str(tmp_path / "hf"))
    assert export.exit_code == 0, export.output
    assert (tmp_path / "hf" / "model.safetensors").is_file()
