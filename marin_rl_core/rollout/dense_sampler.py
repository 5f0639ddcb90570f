"""The dense sampler: for short responses (the default task's), each decode step recomputes the
whole sequence on device, with no KV cache and no per-sequence host work; its logits come from
the same :func:`~marin_rl_core.models.logprobs.tempered_logits` as the trainer's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.models.logprobs import tempered_logits
from marin_rl_core.models.packing import BATCH, POS, row_length
from marin_rl_core.rollout.inference import Sample, Sampler, check_request


def _bucket(n: int, *, multiple: int) -> int:
    """``n`` rounded up to a power of two below ``multiple``, else to a multiple of it: few
    distinct batch heights, so few compilations."""
    if n > multiple:
        return -(-n // multiple) * multiple
    size = 1
    while size < n:
        size *= 2
    return size


def _pad(values: np.ndarray, size: int, fill: int) -> jax.Array:
    out = np.full(size, fill, dtype=values.dtype)
    out[: values.size] = values
    return jnp.asarray(out)


@eqx.filter_jit
def _dense_sample(
    model: LmHeadModel,
    tokens: jax.Array,
    prompt_len: jax.Array,
    budget: jax.Array,
    seeds: jax.Array,
    fold: jax.Array,
    sample: jax.Array,
    temperature: jax.Array,
    stops: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample responses for right-padded prompts with one full forward pass per token.

    ``tokens [B, T]`` holds each prompt at ``0..prompt_len-1``; row ``b`` gets up to
    ``budget[b]`` tokens, drawn with ``fold_in(key_b, step)`` where ``key_b`` is
    ``PRNGKey(seeds[b])``, folded with ``fold[b]`` (unless negative) and then ``sample[b]``; a
    row ends at a stop token. Returns ``(tokens, logprobs, lengths)``: the rows with their
    responses written in (nothing after a row's end), each response token's logprob at the
    token's position, and each response's length. The logits come from the same forward pass and the
    same float32 projection (:func:`~marin_rl_core.models.logprobs.tempered_logits`) as the trainer's
    :func:`~marin_rl_core.models.logprobs.next_token_logprobs`, so the logprobs agree with it.
    """
    rows, width = tokens.shape
    lm_head = model.get_lm_head().rearrange((model.Embed, model.Vocab)).array

    def row_key(seed, fold, sample):  # type: ignore[no-untyped-def]
        key = jax.random.PRNGKey(seed)
        key = jnp.where(fold >= 0, jax.random.fold_in(key, fold), key)
        return jax.random.fold_in(key, sample)

    keys = jax.vmap(row_key)(seeds, fold, sample)
    greedy = temperature <= 0
    safe_t = jnp.broadcast_to(jnp.where(greedy, 1.0, temperature), (rows,))
    row_index = jnp.arange(rows)

    def body(carry):  # type: ignore[no-untyped-def]
        step, tokens, logprobs, done, lengths = carry
        ids = hax.named(tokens, (BATCH, POS))
        hidden = model.activations(ids, attn_mask=AttentionMask.causal())
        hidden = hidden.rearrange((BATCH, POS, model.Embed)).array
        at = jnp.clip(prompt_len + step - 1, 0, width - 1)
        logits = tempered_logits(hidden[row_index, at], lm_head, safe_t)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        drawn = jax.vmap(jax.random.categorical)(step_keys, logits)
        new = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(tokens.dtype)
        logprob = jnp.take_along_axis(logits, new[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(
            logits, axis=-1
        )
        live = ~done
        pos = jnp.clip(prompt_len + step, 0, width - 1)
        tokens = tokens.at[row_index, pos].set(jnp.where(live, new, tokens[row_index, pos]))
        logprobs = logprobs.at[row_index, pos].set(jnp.where(live, logprob, 0.0))
        stopped = jnp.any(new[:, None] == stops[None, :], axis=-1)
        done = done | (live & (stopped | (step + 1 >= budget)))
        return step + 1, tokens, logprobs, done, lengths + live

    def cond(carry):  # type: ignore[no-untyped-def]
        return ~jnp.all(carry[3])

    done = budget <= 0
    logprobs = jnp.zeros(tokens.shape, jnp.float32)
    lengths = jnp.zeros(budget.shape, jnp.int32)
    init = (jnp.zeros((), jnp.int32), tokens, logprobs, done, lengths)
    _, tokens, logprobs, _, lengths = jax.lax.while_loop(cond, body, init)
    return tokens, logprobs, lengths


class DenseSampler(Sampler):
    """Samples short responses with plain jitted forward passes: the prompts are right-padded
    into one ``[rows, positions]`` array and each new token costs one forward pass over it (no
    KV cache). For short generations from small models this is several times faster than the
    paged :class:`SamplingEngine`, whose host-side work per sequence dominates there; for long
    generations it is the slower one (``model.inference_engine``, :func:`choose_engine`).

    Same interface and guarantees as :class:`SamplingEngine`: ``result[i][k]`` is the ``k``-th
    sample of prompt ``i``; the seed (or ``prompt_seeds``) fixes the samples; logprobs are of the
    tempered distribution and equal the trainer's (``tests/test_inference.py`` runs the same
    tests on both). Its compiled function has no host callbacks, so JAX's persistent
    compilation cache keeps it across runs.

    Args:
        model, max_seq_len, eos_id, max_seqs, max_stop_tokens, compute_dtype, mesh,
            axis_mapping: as for :class:`SamplingEngine`; ``max_seqs`` rows are sampled per
            forward pass (more are split into chunks).
    """

    def __init__(
        self,
        model: LmHeadModel,
        *,
        max_seq_len: int,
        eos_id: int,
        max_seqs: int = 256,
        max_stop_tokens: int = 4,
        compute_dtype: jnp.dtype = jnp.float32,
        mesh: Any = None,
        axis_mapping: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(
            model,
            max_seq_len=max_seq_len,
            eos_id=eos_id,
            max_stop_tokens=max_stop_tokens,
            compute_dtype=compute_dtype,
            mesh=mesh,
            axis_mapping=axis_mapping,
        )
        self.max_seqs = max_seqs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int = 16,
        stop_tokens: Sequence[int] = (),
        seed: int = 0,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """As :meth:`SamplingEngine.generate`."""
        stops = check_request(
            prompts, n, stop_tokens, prompt_seeds,
            eos_id=self.eos_id, max_seqs=self.max_seqs, max_stop_tokens=self.max_stop_tokens,
            max_seq_len=self.max_seq_len,
        )  # fmt: skip
        stop_array = np.full(self.max_stop_tokens, stops[0], dtype=np.int32)
        stop_array[: len(stops)] = stops
        # Each row's key: PRNGKey(seed) folded with the prompt's index, or PRNGKey of the
        # prompt's own seed; then folded with the sample's index (see _dense_sample).
        count = len(prompts) * n
        prompt_of = np.repeat(np.arange(len(prompts), dtype=np.int32), n)
        sample_of = np.tile(np.arange(n, dtype=np.int32), len(prompts))
        if prompt_seeds is None:
            seed_of = np.full(count, seed % 2**32, dtype=np.uint32)
            fold_of = prompt_of
        else:
            per_prompt = np.asarray([int(x) % 2**32 for x in prompt_seeds], dtype=np.uint32)
            seed_of = np.repeat(per_prompt, n)
            fold_of = np.full(count, -1, dtype=np.int32)

        results: list[list[Sample]] = [[] for _ in prompts]
        stop_set = set(stops)
        for start in range(0, count, self.max_seqs):
            rows = range(start, min(start + self.max_seqs, count))
            size = len(rows)
            lengths = np.asarray([len(prompts[prompt_of[r]]) for r in rows], dtype=np.int32)
            budgets = np.minimum(max_tokens, self.max_seq_len - lengths).astype(np.int32)
            width = row_length(int((lengths + budgets).max()), self.max_seq_len)
            height = _bucket(size, multiple=64)
            tokens = np.zeros((height, width), dtype=np.int32)
            for row, r in enumerate(rows):
                tokens[row, : lengths[row]] = prompts[prompt_of[r]]

            with self._on_mesh():
                out_tokens, out_logprobs, out_lengths = _dense_sample(
                    self._model,
                    jnp.asarray(tokens),
                    _pad(lengths, height, 1),
                    _pad(budgets, height, 0),
                    _pad(seed_of[start : start + size], height, 0),
                    _pad(fold_of[start : start + size], height, -1),
                    _pad(sample_of[start : start + size], height, 0),
                    jnp.asarray(temperature, jnp.float32),
                    jnp.asarray(stop_array),
                )
            out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
            out_lengths = np.asarray(out_lengths)
            for row, r in enumerate(rows):
                begin, end = int(lengths[row]), int(lengths[row] + out_lengths[row])
                response = out_tokens[row, begin:end]
                results[prompt_of[r]].append(
                    Sample(
                        tokens=response,
                        logprobs=out_logprobs[row, begin:end],
                        stopped=end > begin and int(response[-1]) in stop_set,
                    )
                )
        return results


__all__ = ["DenseSampler"]
