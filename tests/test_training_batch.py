"""Rollouts -> TrainingBatch: padding, truncation and the next-token alignment."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from marin_rl_core import Rollout
from marin_rl_core.learner.loss import step_loss
from marin_rl_core.learner.training_batch import TrainingBatch, training_batch_from_rollouts
from marin_rl_core.models.packing import pack_sequences

PAD = 0


def rollout(prompt, response, logprobs, reward=1.0) -> Rollout:
    return Rollout.single_turn(
        env_name="mock",
        lesson_id="l",
        problem_id="p",
        prompt_tokens=prompt,
        response_tokens=response,
        response_logprobs=logprobs,
        reward=reward,
    )


def test_values_sit_at_the_position_that_predicts_each_response_token():
    r = rollout([1, 5, 6], [7, 2], [-0.1, -0.2])
    batch = training_batch_from_rollouts([r], [0.5], 8, PAD)
    assert isinstance(batch, TrainingBatch)
    assert batch.Batch.size == 1 and batch.Pos.size == 8
    np.testing.assert_array_equal(batch.input_ids.array[0], [1, 5, 6, 7, 2, 0, 0, 0])
    # Position 2 (token 6) predicts the first response token 7; position 3 predicts 2.
    np.testing.assert_array_equal(batch.loss_mask.array[0], [0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(batch.behaviour_logprobs.array[0], [0, 0, -0.1, -0.2, 0, 0, 0, 0])
    np.testing.assert_allclose(batch.advantages.array[0], [0, 0, 0.5, 0.5, 0, 0, 0, 0])
    np.testing.assert_allclose(batch.temperature.array, [1.0])
    assert float(batch.num_response_tokens.array) == 2


def test_rows_of_different_lengths_are_right_padded_independently():
    rs = [rollout([1, 2], [3], [-1.0]), rollout([1, 2, 3, 4], [5, 6, 7], [-1.0, -2.0, -3.0])]
    batch = training_batch_from_rollouts(rs, [1.0, -1.0], 8, PAD, temperature=0.7)
    np.testing.assert_array_equal(
        batch.input_ids.array, [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 0]]
    )
    np.testing.assert_array_equal(batch.loss_mask.array.sum(axis=1), [1, 3])
    np.testing.assert_allclose(batch.advantages.array[1, 3:6], [-1, -1, -1])
    np.testing.assert_allclose(batch.temperature.array, [0.7, 0.7])


def test_one_temperature_per_rollout_and_a_count_check():
    rs = [rollout([1], [2], [-0.5]), rollout([1], [3], [-0.5])]
    batch = training_batch_from_rollouts(
        rs, [1.0, 1.0], 4, PAD, temperature=[0.5, 1.5], batch_size=3
    )
    np.testing.assert_allclose(batch.temperature.array, [0.5, 1.5, 1.0])
    with pytest.raises(ValueError, match="3 temperatures for 2 rollouts"):
        training_batch_from_rollouts(rs, [1.0, 1.0], 4, PAD, temperature=[1.0, 1.0, 1.0])


def test_too_long_rollouts_lose_the_end_of_their_response():
    r = rollout([1, 2, 3], list(range(10, 20)), -np.arange(1, 11, dtype=np.float32))
    batch = training_batch_from_rollouts([r], [1.0], 8, PAD)
    np.testing.assert_array_equal(batch.input_ids.array[0], [1, 2, 3, 10, 11, 12, 13, 14])
    # Five response tokens fit; the last position predicts nothing.
    np.testing.assert_array_equal(batch.loss_mask.array[0], [0, 0, 1, 1, 1, 1, 1, 0])
    np.testing.assert_allclose(batch.behaviour_logprobs.array[0, 2:7], [-1, -2, -3, -4, -5])


def test_batch_size_pads_with_empty_rows():
    batch = training_batch_from_rollouts([rollout([1], [2], [-0.5])], [1.0], 4, PAD, batch_size=3)
    assert batch.Batch.size == 3
    np.testing.assert_array_equal(batch.loss_mask.array.sum(axis=1), [1, 0, 0])
    with pytest.raises(ValueError, match="smaller than"):
        training_batch_from_rollouts(
            [rollout([1], [2], [-0.5])] * 2, [1.0, 1.0], 4, PAD, batch_size=1
        )


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="2 advantages for 1 rollouts"):
        training_batch_from_rollouts([rollout([1], [2], [-0.5])], [1.0, 2.0], 4, PAD)
    with pytest.raises(ValueError, match="leaves no room for a response"):
        pack_sequences([[1, 2, 3, 4]], [[5]], max_seq_len=4, pad_id=PAD)
    with pytest.raises(ValueError, match="prompt is empty"):
        pack_sequences([[]], [[5]], max_seq_len=4, pad_id=PAD)


def test_training_batch_is_a_jax_pytree():
    import jax

    batch = training_batch_from_rollouts([rollout([1, 2], [3, 4], [-1.0, -1.0])], [2.0], 6, PAD)
    doubled = jax.tree.map(lambda x: x * 2, batch)
    np.testing.assert_allclose(doubled.advantages.array, batch.advantages.array * 2)


# --- packing ---------------------------------------------------------------------------------


def multi_turn(tokens, mask, reward=1.0) -> Rollout:
    mask = np.asarray(mask, bool)
    starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
    return Rollout(
        env_name="game", lesson_id="l", problem_id="p", tokens=tokens, loss_mask=mask,
        logprobs=np.where(mask, -0.5, 0.0), reward=reward, turn_starts=starts,
        turn_rewards=[0.0] * (len(starts) - 1) + [reward],
    )  # fmt: skip


def test_packing_puts_short_rollouts_in_one_row_and_keeps_them_apart():
    from marin_rl_core.learner.training_batch import padded_fraction
    from marin_rl_core.models.packing import pack_rows

    assert pack_rows([6, 3, 5, 2], 8) == [[0, 3], [1, 2]]
    short = [rollout([1, 5], [7], [-0.1]), rollout([1, 6, 6], [8, 2], [-0.2, -0.3])]
    game = multi_turn([1, 9, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1])
    rollouts = [*short, game]
    plain = training_batch_from_rollouts(rollouts, [1.0, -1.0, 0.5], 8, PAD, temperature=[1, 2, 3])
    packed = training_batch_from_rollouts(
        rollouts, [1.0, -1.0, 0.5], 8, PAD, temperature=[1, 2, 3], pack=True, row_multiple=2
    )
    assert plain.Batch.size == 3 and packed.Batch.size == 2
    assert padded_fraction(packed, rollouts) < padded_fraction(plain, rollouts)
    ids = np.asarray(packed.input_ids.array)
    # First fit decreasing: the game (6 tokens) opens row 1... sorted by first rollout, the two
    # short ones (3 + 5 tokens) fill row 0 exactly.
    assert ids.tolist() == [[1, 5, 7, 1, 6, 6, 8, 2], [1, 9, 3, 4, 5, 6, PAD, PAD]]
    segments = np.asarray(packed.segment_ids.array)
    positions = np.asarray(packed.position_ids.array)
    temps = np.asarray(packed.temperature.array)
    # Each rollout keeps its own positions, temperature and loss mask; padding is segment -1.
    for row in range(2):
        for seg in set(segments[row].tolist()) - {-1}:
            where = np.flatnonzero(segments[row] == seg)
            assert positions[row, where].tolist() == list(range(len(where)))
    assert (temps[segments < 0] == 1.0).all()
    # Every policy token is predicted once, with its rollout's advantage and logprob.
    mask = np.asarray(packed.loss_mask.array)
    assert mask.sum() == np.asarray(plain.loss_mask.array).sum() == 1 + 2 + 3
    adv = np.asarray(packed.advantages.array)
    assert sorted(adv[mask > 0].tolist()) == sorted([1.0, -1.0, -1.0, 0.5, 0.5, 0.5])
    # A position whose next token starts another rollout predicts nothing.
    boundary = (segments[:, :-1] != segments[:, 1:]) & (segments[:, :-1] >= 0)
    assert not mask[:, :-1][boundary].any()


def test_packed_rows_give_the_same_logprobs_and_loss_as_one_rollout_per_row():
    import jax
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.learner.training_batch import batch_logprobs_and_entropy
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.packing import pack_rows
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    tok = ArithmeticTokenizer()
    model = build_model(ModelConfig(max_seq_len=16, num_layers=2), tok, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rollouts = []
    for n_prompt, n_response in [(3, 2), (4, 9), (2, 3), (5, 1), (3, 4), (6, 6)]:
        rollouts.append(
            rollout(rng.integers(4, 100, n_prompt), rng.integers(4, 100, n_response),
                    rng.normal(-2, 0.5, n_response), reward=float(rng.random()))
        )  # fmt: skip
    rollouts.append(multi_turn(rng.integers(4, 100, 9), [0, 0, 1, 1, 0, 0, 1, 0, 1]))
    advantages = rng.normal(size=len(rollouts))
    plain = training_batch_from_rollouts(rollouts, advantages, 16, PAD, temperature=0.8)
    packed = training_batch_from_rollouts(rollouts, advantages, 16, PAD, temperature=0.8, pack=True)
    assert packed.Batch.size < plain.Batch.size

    def per_rollout(batch, layout):
        logprobs = np.asarray(batch_logprobs_and_entropy(model, batch)[0].array)
        mask = np.asarray(batch.loss_mask.array) > 0
        out = {}
        for row, members in enumerate(layout):
            start = 0
            for i in members:
                n = min(rollouts[i].num_tokens, 16)
                out[i] = logprobs[row, start : start + n][mask[row, start : start + n]]
                start += n
        return out

    lengths = [min(r.num_tokens, 16) for r in rollouts]
    got = per_rollout(packed, pack_rows(lengths, 16))
    want = per_rollout(plain, [[i] for i in range(len(rollouts))])
    for i in range(len(rollouts)):
        np.testing.assert_allclose(got[i], want[i], atol=1e-5)

    loss_fn = RLOOLoss(RLOOConfig(kl_coef=0.0)).create_loss_fn(None, model)
    np.testing.assert_allclose(
        float(step_loss(loss_fn, model, packed)[0]),
        float(step_loss(loss_fn, model, plain)[0]),
        rtol=1e-5,
    )


def test_trimmed_rows_end_at_the_longest_rollout_and_give_the_same_loss():
    """``trim``: a batch of short rollouts gets rows of its longest row rounded up to a power of
    two (at least 8), not of max_seq_len, and the trainer's logprobs and loss do not change."""
    import jax
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.learner.training_batch import batch_logprobs_and_entropy
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.packing import row_length
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    assert [row_length(n, 64) for n in (1, 7, 8, 9, 17, 40, 64)] == [8, 8, 8, 16, 32, 64, 64]
    assert row_length(30, 20) == 20
    tok = ArithmeticTokenizer()
    model = build_model(ModelConfig(max_seq_len=32, num_layers=2), tok, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    rollouts = [
        rollout(rng.integers(4, 100, p), rng.integers(4, 100, r), rng.normal(-2, 0.5, r),
                reward=float(rng.random()))
        for p, r in [(5, 2), (4, 3), (9, 2), (3, 1)]
    ]  # fmt: skip
    advantages = rng.normal(size=len(rollouts))
    full = training_batch_from_rollouts(rollouts, advantages, 32, PAD, temperature=1.5)
    trimmed = training_batch_from_rollouts(
        rollouts, advantages, 32, PAD, temperature=1.5, trim=True
    )
    assert full.Pos.size == 32 and trimmed.Pos.size == 16  # the longest has 11 tokens
    width = trimmed.Pos.size
    for name in ("input_ids", "loss_mask", "advantages", "behaviour_logprobs"):
        np.testing.assert_array_equal(
            np.asarray(getattr(trimmed, name).array),
            np.asarray(getattr(full, name).array)[:, :width],
        )
    got = np.asarray(batch_logprobs_and_entropy(model, trimmed)[0].array)
    want = np.asarray(batch_logprobs_and_entropy(model, full)[0].array)[:, :width]
    mask = np.asarray(trimmed.loss_mask.array) > 0
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-5)
    loss_fn = RLOOLoss(RLOOConfig(kl_coef=0.0)).create_loss_fn(None, model)
    np.testing.assert_allclose(
        float(step_loss(loss_fn, model, trimmed)[0]),
        float(step_loss(loss_fn, model, full)[0]),
        rtol=1e-5,
    )
    packed = training_batch_from_rollouts(
        rollouts, advantages, 32, PAD, temperature=1.5, pack=True, trim=True
    )
    assert packed.Batch.size == 1 and packed.Pos.size == 32  # 11 + 7 + 7 + 4 = 29 tokens, one row


@pytest.mark.parametrize("pack", [False, True])
def test_token_rewards_sit_where_each_turns_last_action_is_predicted(pack):
    """For value-based losses (GAE): each turn's reward at the position predicting its last
    sampled token; nothing unless the loss asks."""
    game = multi_turn([1, 9, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1], reward=2.0)
    game = attrs.evolve(game, turn_rewards=np.asarray([0.5, 2.0], np.float32))
    short = multi_turn([1, 2, 7], [0, 0, 1], reward=1.0)
    batch = training_batch_from_rollouts([game, short], [0.0, 0.0], 12, 0, pack=pack,
                                         token_rewards=True)  # fmt: skip
    rewards = np.asarray(batch.token_rewards.array)
    # game: actions at tokens 2 (turn 1) and 4, 5 (turn 2): predicted at positions 1, 3, 4.
    assert rewards[0, :6].tolist() == [0.0, 0.5, 0.0, 0.0, 2.0, 0.0]
    start = 6 if pack else 0
    row = 0 if pack else 1
    assert rewards[row, start : start + 3].tolist() == [0.0, 1.0, 0.0]
    assert batch.Batch.size == (1 if pack else 2)
    plain = training_batch_from_rollouts([game, short], [0.0, 0.0], 12, 0, pack=pack)
    assert plain.token_rewards is None
