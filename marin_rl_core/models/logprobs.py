"""Per-token log-probabilities of a levanter model: the one computation the trainer's loss and
the samplers' reported logprobs share.

Alignment convention (shared with :mod:`marin_rl_core.learner.training_batch`): for token ids
``x[0..T-1]`` the value at position ``t`` belongs to the prediction made *at* ``t`` of the *next*
token ``x[t+1]``, so ``next_token_logprobs(...)[t] = log p(x[t+1] | x[0..t])`` and the last
position holds 0.

Logits are computed block by block of positions (at most :data:`LOGITS_BLOCK_BYTES` of float32
logits at once) and recomputed in the backward pass; under FSDP the LM head is applied
vocabulary-parallel (:func:`lm_head_split`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.models import LOGITS_BLOCK_BYTES
from marin_rl_core.models.packing import BATCH, POS, pack_sequences


def tempered_logits(hidden: jax.Array, lm_head: jax.Array, temperature: jax.Array) -> jax.Array:
    """``hidden [n, embed] @ lm_head [embed, vocab]`` in float32, divided by each row's
    ``temperature [n]`` (0 must already be replaced, e.g. by 1). The one projection of hidden
    states to logits: the trainer's log-probabilities and both samplers' (the dense sampler,
    :func:`~marin_rl_core.rollout.dense_sampler._dense_sample`) use it, so they agree."""
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32).astype(jnp.float32)
    return logits / temperature[:, None]


def next_token_logits(model: LmHeadModel, tokens: jax.Array, at: jax.Array) -> jax.Array:
    """The untempered float32 logits of the token after position ``at[r]`` of each row of
    ``tokens [rows, width]`` (int32, each row's tokens then any padding): one causal forward
    pass of the policy and the same float32 projection (:func:`tempered_logits`) the trainer's
    log-probabilities use, so an engine sampling from these reports the trainer's logprobs.
    Returns ``[rows, vocab]``. The dense engine samples with it; so can a third-party engine
    (public as ``marin_rl_core.next_token_logits``; draw with ``draw_next_tokens``)."""
    rows, _ = tokens.shape
    ids = hax.named(tokens, (BATCH, POS))
    hidden = model.activations(ids, attn_mask=AttentionMask.causal())
    hidden = hidden.rearrange((BATCH, POS, model.Embed)).array
    lm_head = model.get_lm_head().rearrange((model.Embed, model.Vocab)).array
    return tempered_logits(hidden[jnp.arange(rows), at], lm_head, jnp.ones(rows, jnp.float32))


def _block_forward(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, temperature: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    logits = tempered_logits(hidden, lm_head, temperature)
    # One pass of exp over the vocabulary serves both the log-sum-exp and the entropy:
    # lse = m + log(s) and entropy = lse - sum(e * logits) / s, with e = exp(logits - m).
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    e = jnp.exp(logits - m[:, None])
    s = jnp.sum(e, axis=-1)
    lse = m + jnp.log(s)
    token_logprobs = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    entropy = lse - jnp.sum(e * logits, axis=-1) / s
    return (token_logprobs, entropy), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_logprobs_and_entropy(
    vocab_parallel: tuple[Any, ...] | None,
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    temperature: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Plain arrays: ``hidden [n, embed]``, ``lm_head [embed, vocab]``, ``targets [n]`` and
    ``temperature [n]`` -> ``(logprob of each target, entropy)``, both ``[n]`` float32.

    The forward pass reduces the logits (a log-sum-exp, a gather, one weighted sum) without a
    ``[n, vocab]`` array of log-probabilities; the backward pass recomputes the logits from
    ``hidden`` and keeps nothing of size ``vocab`` between the two (as levanter's blockwise
    cross-entropy does). Both outputs have gradients (an entropy bonus in a loss trains the
    policy); none flows into ``temperature``.

    ``vocab_parallel``: ``(Embed, Vocab, physical axes)`` when the block is computed vocabulary
    parallel (``lm_head`` split over the vocabulary, ``hidden`` whole on every device): the LM
    head's gradient is then kept split over the vocabulary too; else ``None``.
    """
    return _block_forward(hidden, lm_head, targets, temperature)[0]


def _block_fwd(vocab_parallel, hidden, lm_head, targets, temperature):  # type: ignore[no-untyped-def]
    out, lse = _block_forward(hidden, lm_head, targets, temperature)
    return out, (hidden, lm_head, targets, temperature, lse, out[1])


def _block_bwd(vocab_parallel, residuals, cotangents):  # type: ignore[no-untyped-def]
    hidden, lm_head, targets, temperature, lse, entropy = residuals
    d_logprob, d_entropy = cotangents
    log_probs = tempered_logits(hidden, lm_head, temperature) - lse[:, None]
    probs = jnp.exp(log_probs)
    # A one-hot compare rather than a scatter: elementwise, so a batch sharded over devices
    # stays sharded (a scatter's indices would be gathered onto every device).
    onehot = jnp.arange(probs.shape[-1])[None, :] == targets[:, None]
    # With z the tempered logits: d logprob / dz = onehot(target) - p, and for the entropy
    # H = -sum(p log p): dH / dz = -p (log p + H). Both over T for the raw logits.
    d_logits = (onehot - probs) * d_logprob[:, None] - probs * (
        log_probs + entropy[:, None]
    ) * d_entropy[:, None]
    d_logits = d_logits / temperature[:, None]
    d_hidden = jnp.dot(d_logits, lm_head.T, preferred_element_type=jnp.float32)
    d_lm_head = jnp.dot(hidden.T, d_logits, preferred_element_type=jnp.float32)
    if vocab_parallel is not None:
        # Each device's share of the vocabulary, from every row: the gradient is born split
        # over the vocabulary (no whole [embed, vocab] float32 array on any device), and so is
        # the blocks' running sum of it.
        embed, vocab, physical = vocab_parallel
        d_lm_head = _constrain(d_lm_head, (embed, vocab), {vocab.name: physical})
    return (
        d_hidden.astype(hidden.dtype),
        d_lm_head.astype(lm_head.dtype),
        None,
        jnp.zeros_like(temperature),
    )


_block_logprobs_and_entropy.defvjp(_block_fwd, _block_bwd)


def _shards_of(axes: Sequence[Axis]) -> int:
    """Over how many devices the current axis mapping splits ``axes`` (1 outside a mesh)."""
    shards = 1
    for axis in axes:
        try:
            shards *= hax.partitioning.physical_axis_size(axis) or 1
        except ValueError:  # no mesh
            return 1
    return shards


_LM_HEAD_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "marinrl_lm_head_split", default=False
)


@contextlib.contextmanager
def lm_head_split(split: bool) -> Iterator[None]:
    """Within: the model's parameters (its LM head) are split over devices (FSDP), so
    :func:`next_token_logprobs_and_entropy` computes the LM head vocabulary-parallel. The
    trainer's :class:`~marin_rl_core.learner.step.Learner` says so around everything it traces."""
    token = _LM_HEAD_SPLIT.set(split)
    try:
        yield
    finally:
        _LM_HEAD_SPLIT.reset(token)


def _vocab_parallel_axes(batch_axes: Sequence[Axis], vocab: Axis) -> tuple[str, ...] | None:
    """The physical axes the rows are split over, when the LM head is split over devices too
    (:func:`lm_head_split`; whole on every device, as in plain data parallelism, the rows are
    best left where they are), the rows over more than one device, and the vocabulary divides
    evenly among those devices; else ``None``."""
    if not _LM_HEAD_SPLIT.get():
        return None
    physical: list[str] = []
    for axis in batch_axes:
        try:
            name = hax.partitioning.physical_axis_name(axis)
        except ValueError:  # no mesh
            return None
        if name is not None:
            physical.extend([name] if isinstance(name, str) else name)
    shards = _shards_of(batch_axes)
    if not physical or shards <= 1 or vocab.size % shards:
        return None
    return tuple(physical)


def _constrain(x: jax.Array, axes: tuple[Axis, ...], mapping: dict[str, Any]) -> jax.Array:
    """``x`` laid out as ``mapping`` says for its named ``axes`` (axes it leaves out are whole on
    every device)."""
    return hax.shard(hax.named(x, axes), mapping).array


def next_token_logprobs_and_entropy(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    temperature: float | NamedArray = 1.0,
    key: jax.Array | None = None,
    block_tokens: int | None = None,
    segment_ids: NamedArray | None = None,
    position_ids: NamedArray | None = None,
    with_hidden: bool = False,
) -> Any:
    """Per-position logprob of the next token and entropy of the next-token distribution.

    The logits are computed block by block of positions across all rows (``block_tokens``
    tokens per device per block; by default as many as fit :data:`LOGITS_BLOCK_BYTES`), and
    recomputed in the backward pass rather than stored, so peak memory stays about one block
    of ``[tokens, vocab]`` per device whatever the batch. The batch axes keep their sharding:
    with data parallelism each device computes the logits of its own rows only.

    Args:
        model: the policy.
        input_ids: int ``[..., position]``, right-padded (padding never influences earlier
            positions under the causal mask).
        temperature: the logits are divided by it, matching the sampler's logprobs at that
            temperature (0 means greedy and is treated as 1, as levanter's sampler does). A
            scalar or a named array over the batch axes of ``input_ids``.
        key: dropout key (unused by Llama).
        block_tokens: tokens (rows on one device x positions) per block of logits.
        segment_ids: int ``[..., position]`` for packed rows: a position attends only to
            earlier positions of its own segment (see
            :func:`marin_rl_core.learner.training_batch.training_batch_from_rollouts`).
        position_ids: int ``[..., position]``, each token's position within its segment (the
            rotary embedding's position); ``None`` counts from the start of the row.
        with_hidden: also return the final hidden states ``[..., position, embed]`` (what a
            value head on the policy's trunk reads; no second forward pass).

    Returns:
        ``(logprobs, entropy)``, both float32 ``[..., position]``: ``logprobs[t] = log p(x[t+1] |
        x[..t])`` and ``entropy[t]`` the entropy of ``p(. | x[..t])``; the last position is 0.
    """
    pos = input_ids.resolve_axis(POS)
    mask = AttentionMask.causal()
    if segment_ids is not None:
        mask = mask.with_segment_ids(segment_ids)
    hidden = model.activations(input_ids, attn_mask=mask, key=key, pos_ids=position_ids)
    hidden = hidden.rearrange((*input_ids.axes, model.Embed))
    lm_head = model.get_lm_head().rearrange((model.Embed, model.Vocab)).array
    if isinstance(temperature, NamedArray):
        safe_t = hax.where(temperature == 0, 1.0, temperature).astype(jnp.float32)
        temps = hax.broadcast_to(safe_t, input_ids.axes).array
    else:
        temps = jnp.full(input_ids.array.shape, 1.0 if temperature == 0 else float(temperature))
    targets = hax.roll(input_ids, -1, pos).array

    # Blocks are runs of positions across every row, never runs of flattened rows: the batch
    # axes stay sharded over the data-parallel devices, and each device computes the LM head for
    # its own rows (flattening batch x position would gather every row onto every device).
    batch_axes = tuple(a for a in input_ids.axes if a.name != pos.name)
    # Vocabulary parallel when the rows are split over devices: each device computes every row's
    # logits for its share of the vocabulary (the LM head is split that way; the hidden states
    # of a block, [tokens, embed], are small to gather), rather than gathering the whole LM head
    # and its gradient onto every device for its own rows. The softmax's sums cross devices.
    physical = _vocab_parallel_axes(batch_axes, model.Vocab)
    vocab_parallel = None
    if physical is not None:
        vocab_parallel = (model.Embed, model.Vocab, physical)
        lm_head = _constrain(lm_head, (model.Embed, model.Vocab), {model.Vocab.name: physical})
    rows = math.prod(a.size for a in batch_axes)
    local_rows = max(1, -(-rows // _shards_of(batch_axes)))
    budget = block_tokens or max(1, LOGITS_BLOCK_BYTES // (4 * model.Vocab.size))
    block = max(1, budget // local_rows)
    # [rows, position, ...] plain arrays, positions second.
    at = input_ids.axes.index(pos)
    flat = (
        jnp.moveaxis(hidden.array, at, len(batch_axes)).reshape(rows, pos.size, -1),
        jnp.moveaxis(targets, at, -1).reshape(rows, pos.size),
        jnp.moveaxis(temps, at, -1).reshape(rows, pos.size).astype(jnp.float32),
    )

    def per_block(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, t, temp = xs
        n = h.shape[0] * h.shape[1]
        h = h.reshape(n, -1)
        if vocab_parallel is not None:
            h = _constrain(h, (Axis("block_tokens", n), model.Embed), {})
        lp, ent = _block_logprobs_and_entropy(
            vocab_parallel, h, lm_head, t.reshape(n), temp.reshape(n)
        )
        return lp.reshape(t.shape), ent.reshape(t.shape)

    if block >= pos.size:
        token_logprobs, entropy = per_block(flat)
    else:
        blocks = -(-pos.size // block)
        extra = blocks * block - pos.size
        # Padding positions get temperature 1: a zero there would put NaNs into the gradients.
        padded = [
            jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
            for x, fill in zip(flat, (0, 0, 1))
        ]
        # [blocks, rows, block, ...]: the rows stay where the sharding has them.
        stacked = tuple(
            jnp.moveaxis(x.reshape(rows, blocks, block, *x.shape[2:]), 1, 0) for x in padded
        )
        token_logprobs, entropy = jax.lax.map(per_block, stacked)
        token_logprobs, entropy = (
            jnp.moveaxis(x, 0, 1).reshape(rows, blocks * block)[:, : pos.size]
            for x in (token_logprobs, entropy)
        )
    # Back to the input's axis order.
    shape = [a.size for a in batch_axes] + [pos.size]
    token_logprobs, entropy = (
        jnp.moveaxis(x.reshape(shape), -1, at) for x in (token_logprobs, entropy)
    )
    token_logprobs = hax.named(token_logprobs, input_ids.axes)
    entropy = hax.named(entropy, input_ids.axes)
    not_last = hax.arange(pos) < pos.size - 1
    out = hax.where(not_last, token_logprobs, 0.0), hax.where(not_last, entropy, 0.0)
    return (*out, hidden) if with_hidden else out


def next_token_logprobs(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    temperature: float | NamedArray = 1.0,
    key: jax.Array | None = None,
    block_tokens: int | None = None,
    segment_ids: NamedArray | None = None,
    position_ids: NamedArray | None = None,
) -> NamedArray:
    """``log p(x[t+1] | x[..t])`` at each position ``t`` (0 at the last); see
    :func:`next_token_logprobs_and_entropy`."""
    return next_token_logprobs_and_entropy(
        model,
        input_ids,
        temperature=temperature,
        key=key,
        block_tokens=block_tokens,
        segment_ids=segment_ids,
        position_ids=position_ids,
    )[0]


@eqx.filter_jit
def _batch_logprobs(model: LmHeadModel, input_ids: NamedArray, temperature: float) -> NamedArray:
    return next_token_logprobs(model, input_ids, temperature=temperature)


def response_logprobs(
    model: LmHeadModel,
    prompts: Sequence[Sequence[int] | np.ndarray],
    responses: Sequence[Sequence[int] | np.ndarray],
    *,
    max_seq_len: int,
    pad_id: int = 0,
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """The logprob of each response token given its prompt and the response before it, for a
    batch of (prompt, response) pairs: what the sampler reported when it drew them from ``model``.

    Sequences longer than ``max_seq_len`` lose their response's tail; the returned arrays then
    cover only the kept tokens.
    """
    packed = pack_sequences(prompts, responses, max_seq_len=max_seq_len, pad_id=pad_id)
    ids = hax.named(jnp.asarray(packed.input_ids), (BATCH, POS))
    logprobs = np.asarray(_batch_logprobs(model, ids, temperature).array)
    out = []
    for row, (start, length) in enumerate(zip(packed.response_starts, packed.response_lengths)):
        # Response token j sits at position start + j and is predicted at start + j - 1.
        out.append(logprobs[row, start - 1 : start - 1 + length].astype(np.float32))
    return out


__all__ = [
    "LOGITS_BLOCK_BYTES",
    "lm_head_split",
    "next_token_logits",
    "next_token_logprobs",
    "next_token_logprobs_and_entropy",
    "response_logprobs",
    "tempered_logits",
]
