"""What the trainer's loss sees: rollouts laid out as right-padded token rows with named axes.

Each rollout becomes one row ``rollout.tokens + padding`` of ``max_seq_len`` tokens. Every
per-token array is aligned with the *prediction* made at a position, not with the token there:
the value at position ``t`` concerns the token ``input_ids[t+1]`` that the model predicts from
``input_ids[..t]``. So:

* ``loss_mask[t] = rollout.loss_mask[t+1]``: 1 at the positions that predict a token the policy
  sampled (every action of every turn: a multi-turn rollout has several masked spans), 0 for
  prompt, observation and padding tokens and at the last position;
* ``behaviour_logprobs[t] = rollout.logprobs[t+1]`` where masked;
* ``advantages[t]`` is the rollout's advantage on masked positions, 0 elsewhere.

For a single-turn rollout with a prompt of length ``P`` and a response of length ``R`` the mask is
1 on ``[P-1, P-1+R)``.

:func:`marin_rl_core.models.logprobs.next_token_logprobs` uses the same convention, so
``next_token_logprobs(model, batch.input_ids) * batch.loss_mask`` lines up with
``batch.behaviour_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from marin_rl_core.models.logprobs import next_token_logprobs_and_entropy
from marin_rl_core.models.packing import BATCH, POS, pack_rows, row_length
from marin_rl_core.protocols import LOSS_AGGREGATIONS
from marin_rl_core.types import Rollout


class TrainingBatch(eqx.Module):
    """A batch of rollouts for the loss, every field a haliax ``NamedArray``.

    Per-token fields are ``[batch, position]`` and aligned with the prediction made at each
    position (see the module docstring).

    Args:
        input_ids: int32 token ids, right-padded.
        loss_mask: float32, 1 at positions that predict a response token.
        advantages: float32, the rollout's advantage at masked positions, 0 elsewhere.
        behaviour_logprobs: float32, the sampling policy's logprob of the predicted token at
            masked positions, 0 elsewhere.
        temperature: float32 ``[batch]`` (``[batch, position]`` when packed), the temperature
            the behaviour logprobs were sampled at; losses divide the logits by it so the
            importance ratio compares like with like.
        segment_ids: ``None``, or for packed rows int32 ``[batch, position]``: which rollout of
            the row each position holds (0, 1, ...; -1 for padding). Attention stays within a
            segment.
        position_ids: ``None``, or for packed rows int32 ``[batch, position]``: each token's
            position within its rollout.
        loss_weight: float32, each position's weight in the step's loss by the loss's
            aggregation, computed over the whole step (:mod:`~marin_rl_core.learner.loss`); 0
            outside the mask. ``None`` (a batch made by hand): token mean per micro-batch.
        token_weight: float32, ``loss_mask / (response tokens of the step)``: per-token metrics
            are reported as means with it.
        token_rewards: ``None``, or (for value-based losses, which ask for them) float32: the
            reward of the token predicted at each masked position (``Rollout.dense_rewards``:
            each turn's reward on its last sampled token, unless the env gave per-token ones).
        prepared: ``None``, or per-token ``[batch, position]`` arrays by name that the loss
            computed from the model once per trainer step, before any of its updates
            (``RLLossModule.create_prepare_fn``; PPO's old values and whitened advantages).

    Losses pass ``segment_ids`` and ``position_ids`` on to
    :func:`~marin_rl_core.models.logprobs.next_token_logprobs_and_entropy` (``batch_logprobs_and_entropy``
    does it for them).
    """

    input_ids: NamedArray
    loss_mask: NamedArray
    advantages: NamedArray
    behaviour_logprobs: NamedArray
    temperature: NamedArray
    segment_ids: NamedArray | None = None
    position_ids: NamedArray | None = None
    loss_weight: NamedArray | None = None
    token_weight: NamedArray | None = None
    token_rewards: NamedArray | None = None
    prepared: dict[str, NamedArray] | None = None

    @property
    def Batch(self) -> Axis:
        return self.input_ids.resolve_axis(BATCH)

    @property
    def Pos(self) -> Axis:
        return self.input_ids.resolve_axis(POS)

    @property
    def num_response_tokens(self) -> NamedArray:
        return hax.sum(self.loss_mask)


def padded_fraction(batch: TrainingBatch, rollouts: Sequence[Rollout]) -> float:
    """The share of ``batch``'s positions (built from ``rollouts``) that hold no token."""
    width = batch.Pos.size
    tokens = sum(min(r.num_tokens, width) for r in rollouts)
    return 1.0 - tokens / (batch.Batch.size * width)


def training_batch_from_rollouts(
    rollouts: Sequence[Rollout],
    advantages: Sequence[float] | np.ndarray,
    max_seq_len: int,
    pad_id: int,
    *,
    temperature: float | Sequence[float] | np.ndarray = 1.0,
    batch_size: int | None = None,
    pack: bool = False,
    row_multiple: int = 1,
    trim: bool = False,
    aggregation: str | tuple[str, int] = "token_mean",
    token_rewards: bool = False,
) -> TrainingBatch:
    """Build a :class:`TrainingBatch` from rollouts and one advantage per rollout.

    Args:
        rollouts: the rollouts, in batch order.
        advantages: one float per rollout (from ``RLLossModule.compute_advantages``), spread
            over the tokens that rollout's policy sampled.
        max_seq_len: the row length; longer rollouts lose their end.
        pad_id: the token id that fills the rest of a row (always masked out).
        temperature: the sampling temperature of the rollouts: one for all, or one per rollout
            (a batch may mix lessons sampled at different temperatures). Padding gets 1.
        batch_size: without packing, pad the batch with empty rows (all-zero mask) up to this
            many, so that a jitted step sees one shape; ``None`` uses ``len(rollouts)``. With
            packing, the most rows a batch has: rounding up to ``row_multiple`` stops there
            (the trainer's micro-batches and data shards divide the batch size, not always a
            rounded-up row count).
        pack: put several rollouts in one row where they fit (:func:`pack_rows`), with
            ``segment_ids`` and ``position_ids`` that keep them apart, so short rollouts do not
            waste padded positions.
        row_multiple: with ``pack``, the number of rows is rounded up to a multiple of this
            (fewer distinct shapes to compile; micro-batches and data-parallel shards divide it).
        trim: rows end after the batch's longest row, rounded up (:func:`row_length`), instead
            of at ``max_seq_len``: a batch of short rollouts then costs what its tokens cost.
        aggregation: the loss's (``RLLossModule.aggregation``): ``loss_weight`` weighs each
            token by it over the whole batch; the ``L`` of ``"sum_over_length"`` is 0 for
            ``max_seq_len``.
        token_rewards: fill ``TrainingBatch.token_rewards`` (a value-based loss asks for them).
    """
    advantages = np.asarray(advantages, dtype=np.float32).reshape(-1)
    if advantages.shape[0] != len(rollouts):
        raise ValueError(f"{advantages.shape[0]} advantages for {len(rollouts)} rollouts")
    for i, rollout in enumerate(rollouts):
        if rollout.prompt_length >= max_seq_len:
            raise ValueError(
                f"row {i}: the prompt has {rollout.prompt_length} tokens, which leaves no room "
                f"for a response in max_seq_len={max_seq_len}; raise model.max_seq_len or "
                "shorten the prompts"
            )
    temps_of = np.ones(len(rollouts), dtype=np.float32)
    given = np.asarray(temperature, dtype=np.float32)
    if given.ndim == 0:
        temps_of[:] = given
    elif given.shape != (len(rollouts),):
        raise ValueError(f"{given.shape[0]} temperatures for {len(rollouts)} rollouts")
    else:
        temps_of[:] = given
    lengths = [min(r.num_tokens, max_seq_len) for r in rollouts]
    # Each rollout's response tokens (those the rows keep): the step's loss weights come from them.
    counts = np.asarray(
        [float(r.loss_mask[1:n].sum()) for r, n in zip(rollouts, lengths, strict=True)]
    )
    rollout_weight = _rollout_weights(counts, aggregation, max_seq_len)
    step_tokens = max(float(counts.sum()), 1.0)
    if pack:
        layout = pack_rows(lengths, max_seq_len)
        n = max(1, -(-len(layout) // row_multiple)) * row_multiple
        if batch_size is not None:
            n = min(n, max(batch_size, len(layout)))
    else:
        n = len(rollouts) if batch_size is None else batch_size
        if n < len(rollouts):
            raise ValueError(
                f"batch_size={batch_size} is smaller than the {len(rollouts)} rollouts"
            )
        layout = [[i] for i in range(len(rollouts))]
    if trim:
        longest = max((sum(lengths[i] for i in members) for members in layout), default=1)
        max_seq_len = row_length(longest, max_seq_len)
    input_ids = np.full((n, max_seq_len), pad_id, dtype=np.int32)
    loss_mask = np.zeros((n, max_seq_len), dtype=np.float32)
    token_advantages = np.zeros((n, max_seq_len), dtype=np.float32)
    behaviour = np.zeros((n, max_seq_len), dtype=np.float32)
    segments = np.full((n, max_seq_len), -1, dtype=np.int32)
    positions = np.zeros((n, max_seq_len), dtype=np.int32)
    token_temps = np.ones((n, max_seq_len), dtype=np.float32)
    loss_weight = np.zeros((n, max_seq_len), dtype=np.float32)
    rewards = np.zeros((n, max_seq_len), dtype=np.float32) if token_rewards else None
    for row, members in enumerate(layout):
        start = 0
        for segment, i in enumerate(members):
            rollout, length = rollouts[i], lengths[i]
            span = slice(start, start + length)
            input_ids[row, span] = rollout.tokens[:length]
            # Position t predicts token t + 1: shift the per-token arrays left by one. The last
            # position of a segment predicts the next segment's first token: masked out.
            predicting = slice(start, start + length - 1)
            mask = rollout.loss_mask[1:length].astype(np.float32)
            loss_mask[row, predicting] = mask
            token_advantages[row, predicting] = mask * advantages[i]
            loss_weight[row, predicting] = mask * rollout_weight[i]
            if rewards is not None:
                rewards[row, predicting] = mask * rollout.dense_rewards()[1:length]
            behaviour[row, predicting] = np.where(mask > 0, rollout.logprobs[1:length], 0.0)
            if pack:  # one rollout per row needs neither: its row is its segment
                segments[row, span] = segment
                positions[row, span] = np.arange(length)
                token_temps[row, span] = temps_of[i]
            start += length
    axes = (Axis(BATCH, n), Axis(POS, max_seq_len))

    def named(array: np.ndarray, names: tuple[Axis, ...] = axes) -> NamedArray:
        return hax.named(jnp.asarray(array), names)

    if pack:
        temps = named(token_temps)
        segment_ids, position_ids = named(segments), named(positions)
    else:
        row_temps = np.ones((n,), dtype=np.float32)
        row_temps[: len(rollouts)] = temps_of
        temps = named(row_temps, axes[:1])
        segment_ids = position_ids = None
    return TrainingBatch(
        input_ids=named(input_ids),
        loss_mask=named(loss_mask),
        advantages=named(token_advantages),
        behaviour_logprobs=named(behaviour),
        temperature=temps,
        segment_ids=segment_ids,
        position_ids=position_ids,
        loss_weight=named(loss_weight),
        token_weight=named(loss_mask / np.float32(step_tokens)),
        token_rewards=None if rewards is None else named(rewards),
    )


def _rollout_weights(
    counts: np.ndarray, aggregation: str | tuple[str, int], max_seq_len: int
) -> np.ndarray:
    """Each rollout's per-token weight in the step's loss (:mod:`~marin_rl_core.learner.loss`),
    from its response-token count: ``1 / N_tokens``, ``1 / (n_i N_seq)`` or ``1 / (L N_seq)``,
    over rollouts with tokens."""
    how, length = (aggregation, 0) if isinstance(aggregation, str) else aggregation
    if how not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {how!r}; choose one of {LOSS_AGGREGATIONS}")
    sequences = max(int(np.count_nonzero(counts)), 1)
    if how == "token_mean":
        weights = np.full(counts.shape, 1.0 / max(counts.sum(), 1.0))
    elif how == "sequence_mean":
        weights = 1.0 / (np.maximum(counts, 1.0) * sequences)
    else:
        weights = np.full(counts.shape, 1.0 / ((length or max_seq_len) * sequences))
    return weights.astype(np.float32)


def batch_logprobs_and_entropy(
    model: Any, batch: TrainingBatch, *, key: Any = None, with_hidden: bool = False
) -> Any:
    """:func:`~marin_rl_core.models.logprobs.next_token_logprobs_and_entropy` of ``batch`` at its
    temperature, packed rows kept apart: what a loss plugin calls. Both are differentiable: an
    entropy bonus (``- coef * entropy`` in the loss) trains the policy. ``with_hidden`` adds
    the final hidden states ``[batch, position, embed]`` (for a value head)."""
    return next_token_logprobs_and_entropy(
        model,
        batch.input_ids,
        temperature=batch.temperature,
        key=key,
        segment_ids=batch.segment_ids,
        position_ids=batch.position_ids,
        with_hidden=with_hidden,
    )


def batch_hidden_states(model: Any, batch: TrainingBatch, *, key: Any = None) -> NamedArray:
    """``model``'s final hidden states ``[batch, position, embed]`` of ``batch``, packed rows
    kept apart (what a separate critic model reads; no LM head)."""
    from levanter.layers.attention import AttentionMask

    mask = AttentionMask.causal()
    if batch.segment_ids is not None:
        mask = mask.with_segment_ids(batch.segment_ids)
    return model.activations(batch.input_ids, attn_mask=mask, key=key, pos_ids=batch.position_ids)


__all__ = [
    "TrainingBatch",
    "batch_hidden_states",
    "batch_logprobs_and_entropy",
    "padded_fraction",
    "training_batch_from_rollouts",
]
