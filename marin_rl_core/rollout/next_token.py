"""Drawing each row's next token from its logits, with the logprob the trainer will compute for it.

:func:`draw_next_tokens` takes the untempered float32 logits (``hidden @ lm_head``) and each
row's temperature. It draws by inverse CDF over blocks of the vocabulary: one uniform number
per row (Gumbel-max draws one per vocabulary entry: 151,936 a row for Qwen, ~95 ms of a 32-row
decode step on a 2-core CPU), the block sums first, then the cumulative sum within the chosen
block only, so no vocabulary-sized array is written besides the logits, and every cumulative
sum is short enough for float32. Greedy rows (``temperature <= 0``) take the argmax, computed
only when some row is greedy.

The logprob is of the tempered distribution, ``(l - max) / T - log(sum(exp((l - max) / T)))``:
the same value as the trainer's ``log_softmax(l / T)`` up to float rounding
(:func:`~marin_rl_core.models.logprobs.tempered_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128
"""Vocabulary entries per block: vocabularies are padded to a multiple of it (real ones,
Qwen's 151,936 and Llama 3's 128,256, already are one)."""


def safe_temperature(temperature: jax.Array) -> jax.Array:
    """``temperature`` with greedy rows' (``<= 0``) replaced by 1: their logprobs are of the
    untempered distribution."""
    return jnp.where(temperature <= 0, 1.0, temperature)


def draw_next_tokens(
    logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each row's next token and its logprob.

    Args:
        logits: float32 ``[rows, vocab]``, untempered.
        keys: ``[rows, 2]`` uint32 row keys; row ``r`` draws with ``fold_in(keys[r], step[r])``.
        step: ``[rows]`` the token's index in the response.
        temperature: ``[rows]``; ``<= 0`` is greedy.

    Returns:
        ``(tokens [rows] int32, logprobs [rows] float32)``.
    """
    rows, vocab = logits.shape
    t = safe_temperature(temperature)[:, None]
    top = jnp.max(logits, axis=-1, keepdims=True)
    pad = -vocab % BLOCK
    scaled = (logits - top) / t  # <= 0; the padding's exp is 0
    padded = jnp.pad(scaled, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else scaled
    blocks = padded.reshape(rows, -1, BLOCK)
    sums = jnp.exp(blocks).sum(-1)  # [rows, blocks]
    cumulative = jnp.cumsum(sums, axis=-1)
    total = cumulative[:, -1]

    step_keys = jax.vmap(jax.random.fold_in)(keys, step)
    target = jax.vmap(jax.random.uniform)(step_keys) * total
    # The first token whose cumulative probability exceeds the target: its block, then within it.
    chosen = jnp.minimum(jnp.sum(cumulative <= target[:, None], axis=-1), sums.shape[1] - 1)
    before = jnp.take_along_axis(cumulative - sums, chosen[:, None], axis=-1)[:, 0]
    inner = jnp.exp(jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0])
    within = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
    # Rounding may put the target past the block's last token of non-zero probability.
    last = BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    drawn = chosen * BLOCK + jnp.minimum(within, last)

    greedy = temperature <= 0
    token = jax.lax.cond(
        jnp.any(greedy),
        lambda: jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn),
        lambda: drawn,
    ).astype(jnp.int32)
    picked = jnp.take_along_axis(padded, token[:, None], axis=-1)[:, 0]
    return token, picked - jnp.log(total)


__all__ = ["BLOCK", "draw_next_tokens", "safe_temperature"]
