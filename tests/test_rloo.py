"""The rloo loss plugin, checked against a plain numpy implementation of the same math."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss, rloo_advantages

from marin_rl_core import RLLossModule, Rollout, RolloutGroup, build_registry
from marin_rl_core.config import ModelConfig
from marin_rl_core.learner.loss import step_loss
from marin_rl_core.learner.training_batch import training_batch_from_rollouts
from marin_rl_core.models.build import build_model
from marin_rl_core.models.logprobs import next_token_logprobs
from marin_rl_core.models.tokenizer import ArithmeticTokenizer

logprobs_of = eqx.filter_jit(lambda model, ids: next_token_logprobs(model, ids))

CONFIG = ModelConfig(
    hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=4, num_kv_heads=4, max_seq_len=12
)


# --- numpy reference ------------------------------------------------------------------------------


def reference_advantages(rewards, normalize_std=False):
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if n < 2:
        return np.zeros(n)
    out = np.array([r[i] - np.mean(np.delete(r, i)) for i in range(n)])
    if normalize_std:
        out = out / (np.std(r) + 1e-6)
    return out


def reference_loss(logp, behaviour, adv, mask, eps, kl_coef=0.0, ref_logp=None):
    ratio = np.exp(logp - behaviour)
    obj = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    n = mask.sum()
    loss = -(obj * mask).sum() / n
    kl = None
    if kl_coef:
        d = ref_logp - logp
        kl = ((np.exp(d) - d - 1) * mask).sum() / n
        loss += kl_coef * kl
    clipped = np.clip(ratio, 1 - eps, 1 + eps) * adv < ratio * adv
    return loss, {
        "ratio_mean": (ratio * mask).sum() / n,
        "clip_fraction": (clipped * mask).sum() / n,
        "kl": kl,
    }


# --- advantages ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rewards",
    [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0, 0.25], [0.3, 0.3, 0.3], [2.0, -1.0], [0.7]],
)
@pytest.mark.parametrize("normalize_std", [False, True])
def test_leave_one_out_advantages_match_numpy(rewards, normalize_std):
    got = rloo_advantages(np.array(rewards), normalize_std=normalize_std)
    assert got.dtype == np.float32
    np.testing.assert_allclose(
        got, reference_advantages(rewards, normalize_std), rtol=1e-5, atol=1e-6
    )


def test_group_of_one_and_equal_rewards_get_zero_advantage():
    assert rloo_advantages(np.array([1.0])).tolist() == [0.0]
    np.testing.assert_array_equal(rloo_advantages(np.ones(8), normalize_std=True), np.zeros(8))


def make_rollouts(tok, rewards):
    prompt = tok.encode("3+4=", add_bos=True)
    responses = [
        tok.encode("7") + [tok.eos_id],
        tok.encode("8"),
        tok.encode("12") + [tok.eos_id],
        tok.encode("7cat"),
    ]
    rng = np.random.default_rng(0)
    return [
        Rollout.single_turn(
            env_name="math",
            lesson_id="add",
            problem_id="3+4",
            prompt_tokens=prompt,
            response_tokens=resp,
            # Behaviour logprobs near the model's own, so some ratios clip and some do not.
            response_logprobs=-5.0 + rng.normal(scale=0.3, size=len(resp)),
            reward=r,
        )
        for resp, r in zip(responses, rewards)
    ]


def test_compute_advantages_of_a_group():
    tok = ArithmeticTokenizer()
    group = RolloutGroup(rollouts=make_rollouts(tok, [1.0, 0.0, 0.0, 0.5]))
    loss = RLOOLoss(RLOOConfig())
    np.testing.assert_allclose(
        loss.compute_advantages(group), reference_advantages([1, 0, 0, 0.5]), atol=1e-6
    )


# --- loss ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    tok = ArithmeticTokenizer()
    model = build_model(CONFIG, tok, key=jax.random.PRNGKey(0))
    reference = build_model(CONFIG, tok, key=jax.random.PRNGKey(1))
    rollouts = make_rollouts(tok, [1.0, 0.0, 0.0, 0.5])
    advantages = rloo_advantages(np.array([r.reward for r in rollouts]))
    batch = training_batch_from_rollouts(rollouts, advantages, CONFIG.max_seq_len, tok.pad_id)
    return tok, model, reference, batch


@pytest.mark.parametrize("clip_epsilon", [0.2, 0.05])
def test_loss_and_metrics_match_numpy(setup, clip_epsilon):
    _, model, _, batch = setup
    module = RLOOLoss(RLOOConfig(clip_epsilon=clip_epsilon, kl_coef=0.0)).build(None)
    assert not module.needs_reference_model
    loss_fn = module.create_loss_fn(None, model)
    loss, metrics = eqx.filter_jit(step_loss)(loss_fn, model, batch, key=jax.random.PRNGKey(0))
    logp = np.asarray(logprobs_of(model, batch.input_ids).array, dtype=np.float64)
    mask = np.asarray(batch.loss_mask.array, dtype=np.float64)
    want, want_metrics = reference_loss(
        logp,
        np.asarray(batch.behaviour_logprobs.array),
        np.asarray(batch.advantages.array),
        mask,
        clip_epsilon,
    )
    assert float(loss) == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert float(metrics["ratio_mean"]) == pytest.approx(want_metrics["ratio_mean"], rel=1e-4)
    assert float(metrics["clip_fraction"]) == pytest.approx(want_metrics["clip_fraction"], abs=1e-6)
    assert 0 < want_metrics["clip_fraction"] < 1, "the fixture should clip some tokens, not all"
    assert float(metrics["num_tokens"]) == mask.sum()
    assert float(metrics["entropy"]) > 0
    assert "kl" not in metrics


def test_kl_penalty_to_the_reference_model(setup):
    _, model, reference, batch = setup
    module = RLOOLoss(RLOOConfig(kl_coef=0.1))
    assert module.needs_reference_model
    with pytest.raises(ValueError, match="needs the reference model"):
        module.create_loss_fn(None, model)
    loss, metrics = eqx.filter_jit(step_loss)(module.create_loss_fn(reference, model), model, batch)
    mask = np.asarray(batch.loss_mask.array, dtype=np.float64)
    logp = np.asarray(logprobs_of(model, batch.input_ids).array, dtype=np.float64)
    ref_logp = np.asarray(logprobs_of(reference, batch.input_ids).array, dtype=np.float64)
    want, want_metrics = reference_loss(
        logp,
        np.asarray(batch.behaviour_logprobs.array),
        np.asarray(batch.advantages.array),
        mask,
        0.2,
        kl_coef=0.1,
        ref_logp=ref_logp,
    )
    assert float(metrics["kl"]) == pytest.approx(want_metrics["kl"], rel=1e-4)
    assert float(loss) == pytest.approx(want, rel=1e-4)
    # Against itself the KL is zero.
    _, same = eqx.filter_jit(step_loss)(module.create_loss_fn(model, model), model, batch)
    assert float(same["kl"]) == pytest.approx(0.0, abs=1e-7)


def test_a_gradient_step_makes_the_best_response_more_likely(setup):
    import optax

    tok, model, _, batch = setup
    # On-policy behaviour logprobs, as a fresh rollout would have.
    batch = eqx.tree_at(
        lambda b: b.behaviour_logprobs, batch, logprobs_of(model, batch.input_ids) * batch.loss_mask
    )
    loss_fn = RLOOLoss(RLOOConfig(kl_coef=0.0)).create_loss_fn(None, model)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: step_loss(loss_fn, m, batch)[0]))(model)
    optimizer = optax.sgd(0.5)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new_model = eqx.apply_updates(model, updates)

    def sequence_logprob(m, row):
        lp = np.asarray(logprobs_of(m, batch.input_ids).array)[row]
        return (lp * np.asarray(batch.loss_mask.array)[row]).sum()

    # Row 0 had the highest reward (advantage > 0), row 1 the lowest.
    assert sequence_logprob(new_model, 0) > sequence_logprob(model, 0)
    assert sequence_logprob(new_model, 1) < sequence_logprob(model, 1)


def test_the_plugin_is_registered_and_configurable():
    registry = build_registry()
    record = registry.get("loss", "rloo")
    module = record.build(record.config_class(kl_coef=0.05, clip_epsilon=0.1, normalize_std=True))
    assert isinstance(module, RLLossModule)
    assert module.needs_reference_model
    # clip_epsilon, from configs written before clip_low/clip_high, sets both.
    assert (module.objective.clip_low, module.objective.clip_high) == (0.1, 0.1)
    assert module.objective.kl_coef == 0.05
    with pytest.raises(ValueError):
        RLOOConfig(clip_epsilon=-0.1)
    with pytest.raises(ValueError):
        RLOOConfig(clip_low=0.0)
    with pytest.raises(ValueError):
        RLOOConfig(kl_coef=-1.0)
