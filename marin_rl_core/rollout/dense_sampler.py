"""The dense sampler: for short responses (the default task's), each decode step recomputes the
whole sequence on device, with no KV cache and no per-sequence host work; its logits come from
the same :func:`~marin_rl_core.models.logprobs.tempered_logits` as the trainer's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.generation import GenerationRequest, Sample
from marin_rl_core.models.logprobs import next_token_logits
from marin_rl_core.models.packing import row_length
from marin_rl_core.rollout.inference import Sampler, check_requests, row_keys
from marin_rl_core.rollout.next_token import draw_next_tokens


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
    ``budget[b]`` tokens at ``temperature[b]`` (greedy where ``<= 0``), drawn with
    ``fold_in(key_b, step)`` where ``key_b`` is ``PRNGKey(seeds[b])``, folded with ``fold[b]``
    (unless negative) and then ``sample[b]``; a row ends at one of its ``stops[b]``. Returns ``(tokens, logprobs, lengths)``: the rows with their
    responses written in (nothing after a row's end), each response token's logprob at the
    token's position, and each response's length. The logits come from the same forward pass and the
    same float32 projection (:func:`~marin_rl_core.models.logprobs.tempered_logits`) as the trainer's
    :func:`~marin_rl_core.models.logprobs.next_token_logprobs`, so the logprobs agree with it.
    """
    rows, width = tokens.shape
    keys = row_keys(seeds, fold, sample)
    row_index = jnp.arange(rows)

    def body(carry):  # type: ignore[no-untyped-def]
        step, tokens, logprobs, done, lengths = carry
        at = jnp.clip(prompt_len + step - 1, 0, width - 1)
        logits = next_token_logits(model, tokens, at)
        new, logprob = draw_next_tokens(logits, keys, jnp.full(rows, step), temperature)
        live = ~done
        pos = jnp.clip(prompt_len + step, 0, width - 1)
        tokens = tokens.at[row_index, pos].set(jnp.where(live, new, tokens[row_index, pos]))
        logprobs = logprobs.at[row_index, pos].set(jnp.where(live, logprob, 0.0))
        stopped = jnp.any(new[:, None] == stops, axis=-1)
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
    generations it is the slower one (the ``dense`` engine plugin; ``auto`` picks the ``kv``
    engine, faster on both).

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

    name = "dense"

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

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """As :meth:`SamplingEngine.generate <marin_rl_core.rollout.inference.SamplingEngine.generate>`."""
        stops = check_requests(
            requests, eos_id=self.eos_id, max_seqs=self.max_seqs,
            max_stop_tokens=self.max_stop_tokens, max_seq_len=self.max_seq_len,
        )  # fmt: skip
        # One row per sample: its request, its index among the request's samples.
        request_of = np.repeat(np.arange(len(requests)), [r.n for r in requests])
        sample_of = np.concatenate([np.arange(r.n) for r in requests]).astype(np.int32)
        count = request_of.size
        stop_rows = np.zeros((len(requests), self.max_stop_tokens), dtype=np.int32)
        for i, own in enumerate(stops):
            stop_rows[i] = own[0]
            stop_rows[i, : len(own)] = own
        seeds = np.asarray([r.seed % 2**32 for r in requests], dtype=np.uint32)
        folds = np.asarray([r.fold for r in requests], dtype=np.int32)
        temps = np.asarray([r.temperature for r in requests], dtype=np.float32)

        results: list[list[Sample]] = [[] for _ in requests]
        for start in range(0, count, self.max_seqs):
            rows = range(start, min(start + self.max_seqs, count))
            size = len(rows)
            which = request_of[start : start + size]
            lengths = np.asarray([len(requests[i].prompt) for i in which], dtype=np.int32)
            wants = np.asarray([requests[i].max_tokens for i in which], dtype=np.int32)
            budgets = np.minimum(wants, self.max_seq_len - lengths).astype(np.int32)
            width = row_length(int((lengths + budgets).max()), self.max_seq_len)
            height = _bucket(size, multiple=64)
            tokens = np.zeros((height, width), dtype=np.int32)
            for row, i in enumerate(which):
                tokens[row, : lengths[row]] = requests[i].prompt
            stop_array = np.zeros((height, self.max_stop_tokens), dtype=np.int32)
            stop_array[:size] = stop_rows[which]

            with self._on_mesh():
                out_tokens, out_logprobs, out_lengths = _dense_sample(
                    self._model,
                    jnp.asarray(tokens),
                    _pad(lengths, height, 1),
                    _pad(budgets, height, 0),
                    _pad(seeds[which], height, 0),
                    _pad(folds[which], height, -1),
                    _pad(sample_of[start : start + size], height, 0),
                    _pad(temps[which], height, 1),
                    jnp.asarray(stop_array),
                )
            out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
            out_lengths = np.asarray(out_lengths)
            for row, i in enumerate(which):
                begin, end = int(lengths[row]), int(lengths[row] + out_lengths[row])
                response = out_tokens[row, begin:end]
                results[i].append(
                    Sample(
                        tokens=response,
                        logprobs=out_logprobs[row, begin:end],
                        stopped=end > begin and int(response[-1]) in stops[i],
                    )
                )
        return results


__all__ = ["DenseSampler"]
