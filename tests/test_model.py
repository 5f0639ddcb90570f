"""Building the policy, Hugging Face checkpoints, and per-token logprobs."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask

from marin_rl_core.config import ModelConfig
from marin_rl_core.errors import ConfigError
from marin_rl_core.models.build import build_model, load_hf_checkpoint, save_hf_checkpoint
from marin_rl_core.models.logprobs import (
    next_token_logprobs,
    next_token_logprobs_and_entropy,
    response_logprobs,
)
from marin_rl_core.models.tokenizer import ArithmeticTokenizer

CONFIG = ModelConfig(
    hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16
)


@pytest.fixture(scope="module")
def tok() -> ArithmeticTokenizer:
    return ArithmeticTokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(CONFIG, tok, key=jax.random.PRNGKey(0))


def ids_of(rows):
    return hax.named(jnp.asarray(rows, dtype=jnp.int32), ("batch", "position"))


@eqx.filter_jit
def _logits(model, ids):
    return model(ids, attn_mask=AttentionMask.causal())


def logits_of(model, rows):
    return np.asarray(_logits(model, ids_of(rows)).array, dtype=np.float64)


@eqx.filter_jit
def jitted_logprobs(model, ids, temperature=1.0):
    return next_token_logprobs_and_entropy(model, ids, temperature=temperature)


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_fresh_model_has_the_configured_shape(model, tok):
    assert model.Vocab.size == tok.vocab_size
    assert model.config.hidden_dim == 32 and model.config.num_layers == 2
    logits = logits_of(model, [tok.encode("3+4=", add_bos=True)])
    assert logits.shape == (1, 5, tok.vocab_size)
    # The same key gives the same weights (every process builds the same initial policy).
    again = build_model(CONFIG, tok, key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(logits_of(again, [[1, 2, 3]]), logits_of(model, [[1, 2, 3]]))


def test_shape_errors_name_the_fields(tok):
    with pytest.raises(ValueError, match="hidden_dim .* multiple of model.num_heads"):
        build_model(ModelConfig(hidden_dim=30, num_heads=4), tok, key=jax.random.PRNGKey(0))


def test_hf_checkpoint_round_trip_gives_the_same_logits(model, tok, tmp_path):
    save_hf_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    rows = [tok.encode("12+7=19", add_bos=True)]
    # Loaded directly (tokenizer read from the checkpoint directory) ...
    loaded = load_hf_checkpoint(tmp_path / "ckpt")
    np.testing.assert_allclose(logits_of(loaded, rows), logits_of(model, rows), atol=1e-5)
    # ... and through ModelConfig.checkpoint, which ignores the shape fields.
    via_config = build_model(
        ModelConfig(checkpoint=str(tmp_path / "ckpt"), hidden_dim=999, num_heads=1),
        tok,
        key=jax.random.PRNGKey(5),
    )
    np.testing.assert_allclose(logits_of(via_config, rows), logits_of(model, rows), atol=1e-5)


def test_loading_something_that_is_not_a_checkpoint_says_so(tmp_path, tok):
    with pytest.raises(ConfigError, match="not a Hugging Face checkpoint directory"):
        load_hf_checkpoint(tmp_path, tokenizer=tok)


def test_next_token_logprobs_align_with_the_following_token(model, tok):
    row = tok.encode("8+5=13", add_bos=True) + [tok.eos_id]
    logprobs = np.asarray(jitted_logprobs(model, ids_of([row]))[0].array[0])
    expected = log_softmax(logits_of(model, [row])[0])
    for t in range(len(row) - 1):
        assert logprobs[t] == pytest.approx(expected[t, row[t + 1]], abs=1e-5)
    assert logprobs[-1] == 0.0


def test_right_padding_does_not_change_earlier_positions(model, tok):
    row = tok.encode("2+2=4", add_bos=True)
    padded = row + [tok.pad_id] * 5
    short = np.asarray(jitted_logprobs(model, ids_of([row]))[0].array[0])
    long = np.asarray(jitted_logprobs(model, ids_of([padded]))[0].array[0])
    np.testing.assert_allclose(long[: len(row) - 1], short[:-1], atol=1e-5)


def test_temperature_and_entropy(model, tok):
    row = tok.encode("1+1=2", add_bos=True)
    logprobs, entropy = jitted_logprobs(model, ids_of([row]), 2.0)
    tempered = log_softmax(logits_of(model, [row])[0] / 2.0)
    assert float(logprobs.array[0, 0]) == pytest.approx(tempered[0, row[1]], abs=1e-5)
    expected_entropy = -(np.exp(tempered) * tempered).sum(-1)
    np.testing.assert_allclose(np.asarray(entropy.array[0, :-1]), expected_entropy[:-1], rtol=1e-4)
    # Temperature 0 (greedy sampling) reports the untempered distribution, like the sampler.
    greedy = next_token_logprobs(model, ids_of([row]), temperature=0.0)
    plain = next_token_logprobs(model, ids_of([row]), temperature=1.0)
    np.testing.assert_allclose(np.asarray(greedy.array), np.asarray(plain.array))


def test_response_logprobs_of_a_batch(model, tok):
    prompts = [tok.encode("3+4=", add_bos=True), tok.encode("10+10=", add_bos=True)]
    responses = [tok.encode("7") + [tok.eos_id], tok.encode("20")]
    out = response_logprobs(model, prompts, responses, max_seq_len=16, pad_id=tok.pad_id)
    assert [len(o) for o in out] == [2, 1]
    for prompt, response, got in zip(prompts, responses, out):
        full = prompt + response
        expected = log_softmax(logits_of(model, [full])[0])
        want = [expected[len(prompt) - 1 + j, tok_id] for j, tok_id in enumerate(response)]
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_logprobs_and_entropy_block_by_block_match_plain_autodiff_in_values_and_gradients(
    model, tok
):
    rows = ids_of([tok.encode("12+7=19", add_bos=True), tok.encode("3*4=12", add_bos=True)])
    temperature = hax.named(jnp.asarray([1.0, 0.7]), ("batch",))
    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.normal(size=rows.array.shape), jnp.float32)
    # An entropy bonus in the objective: its gradient must reach the model too.
    entropy_weights = jnp.asarray(rng.normal(size=rows.array.shape), jnp.float32)

    def ours(m, block_tokens):
        logprobs, entropy = next_token_logprobs_and_entropy(
            m, rows, temperature=temperature, block_tokens=block_tokens
        )
        objective = jnp.sum(logprobs.array * weights) + jnp.sum(entropy.array * entropy_weights)
        return objective, (logprobs, entropy)

    def plain(m):  # the textbook computation, differentiated by JAX
        logits = m(rows, attn_mask=AttentionMask.causal()).array / temperature.array[:, None, None]
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        targets = jnp.roll(rows.array, -1, axis=1)
        logprobs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        logprobs = logprobs.at[:, -1].set(0.0)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1).at[:, -1].set(0.0)
        return jnp.sum(logprobs * weights) + jnp.sum(entropy * entropy_weights), (logprobs, entropy)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(ours, has_aux=True))
    (_, (lp_plain, ent_plain)), g_plain = eqx.filter_jit(
        eqx.filter_value_and_grad(plain, has_aux=True)
    )(model)
    # 12 positions in blocks of 5 (the last block padded), and all of them in one block.
    for block_tokens in (5, 1000):
        (_, (logprobs, entropy)), g = grad(model, block_tokens)
        np.testing.assert_allclose(np.asarray(logprobs.array), np.asarray(lp_plain), atol=1e-5)
        np.testing.assert_allclose(np.asarray(entropy.array), np.asarray(ent_plain), atol=1e-4)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_plain)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    assert any(float(jnp.abs(a).max()) > 1e-3 for a in jax.tree.leaves(g_plain))
