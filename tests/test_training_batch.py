"""Rollouts -> TrainingBatch: padding, truncation and the next-token alignment."""

from __future__ import annotations

import numpy as np
import pytest

from marin_rl_core import Rollout
from marin_rl_core.training_batch import TrainingBatch, pack_sequences, training_batch_from_rollouts

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
    np.testing.assert_array_equal(batch.input_ids.array, [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 0]])
    np.testing.assert_array_equal(batch.loss_mask.array.sum(axis=1), [1, 3])
    np.testing.assert_allclose(batch.advantages.array[1, 3:6], [-1, -1, -1])
    np.testing.assert_allclose(batch.temperature.array, [0.7, 0.7])


def test_one_temperature_per_rollout_and_a_count_check():
    rs = [rollout([1], [2], [-0.5]), rollout([1], [3], [-0.5])]
    batch = training_batch_from_rollouts(rs, [1.0, 1.0], 4, PAD, temperature=[0.5, 1.5], batch_size=3)
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
        training_batch_from_rollouts([rollout([1], [2], [-0.5])] * 2, [1.0, 1.0], 4, PAD, batch_size=1)


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
