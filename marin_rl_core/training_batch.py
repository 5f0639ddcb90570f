"""What the trainer's loss sees: rollouts laid out as right-padded token rows with named axes.

Each rollout becomes one row ``prompt + response + padding`` of ``max_seq_len`` tokens. Every
per-token array is aligned with the *prediction* made at a position, not with the token there:
the value at position ``t`` concerns the token ``input_ids[t+1]`` that the model predicts from
``input_ids[..t]``. So for a prompt of length ``P`` and a response of length ``R``:

* ``loss_mask[t] = 1`` for ``t`` in ``[P-1, P-1+R)`` (the positions that predict response tokens)
  and 0 elsewhere (prompt, padding, the last position);
* ``behaviour_logprobs[P-1+j] = rollout.response_logprobs[j]``;
* ``advantages[t]`` is the rollout's advantage on masked positions, 0 elsewhere.

:func:`marin_rl_core.model.next_token_logprobs` uses the same convention, so
``next_token_logprobs(model, batch.input_ids) * batch.loss_mask`` lines up with
``batch.behaviour_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from marin_rl_core.types import Rollout

BATCH = "batch"
POS = "position"


@attrs.frozen
class PackedSequences:
    """Prompt + response rows as numpy arrays (see :func:`pack_sequences`).

    Args:
        input_ids: int32 ``[batch, max_seq_len]``.
        response_starts: int32 ``[batch]``, the position of each row's first response token
            (its prompt length).
        response_lengths: int32 ``[batch]``, the response tokens kept after truncation.
    """

    input_ids: np.ndarray
    response_starts: np.ndarray
    response_lengths: np.ndarray


def pack_sequences(
    prompts: Sequence[Sequence[int] | np.ndarray],
    responses: Sequence[Sequence[int] | np.ndarray],
    *,
    max_seq_len: int,
    pad_id: int,
) -> PackedSequences:
    """Lay out each ``prompt + response`` in a row of ``max_seq_len`` tokens, right-padded with
    ``pad_id``. A row that is too long keeps its prompt and loses the end of its response.

    Raises:
        ValueError: for an empty prompt, or a prompt that leaves no room for a response token.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    n = len(prompts)
    input_ids = np.full((n, max_seq_len), pad_id, dtype=np.int32)
    starts = np.zeros(n, dtype=np.int32)
    lengths = np.zeros(n, dtype=np.int32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        p = len(prompt)
        if p == 0:
            raise ValueError(f"row {i}: the prompt is empty; the first response token needs one")
        if p >= max_seq_len:
            raise ValueError(
                f"row {i}: the prompt has {p} tokens, which leaves no room for a response in "
                f"max_seq_len={max_seq_len}; raise model.max_seq_len or shorten the prompts"
            )
        r = min(len(response), max_seq_len - p)
        input_ids[i, :p] = np.asarray(prompt, dtype=np.int32)
        input_ids[i, p : p + r] = np.asarray(response[:r], dtype=np.int32)
        starts[i], lengths[i] = p, r
    return PackedSequences(input_ids, starts, lengths)


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
        temperature: float32 ``[batch]``, the temperature the behaviour logprobs were sampled
            at; losses divide the logits by it so the importance ratio compares like with like.
    """

    input_ids: NamedArray
    loss_mask: NamedArray
    advantages: NamedArray
    behaviour_logprobs: NamedArray
    temperature: NamedArray

    @property
    def Batch(self) -> Axis:
        return self.input_ids.resolve_axis(BATCH)

    @property
    def Pos(self) -> Axis:
        return self.input_ids.resolve_axis(POS)

    @property
    def num_response_tokens(self) -> NamedArray:
        return hax.sum(self.loss_mask)


def training_batch_from_rollouts(
    rollouts: Sequence[Rollout],
    advantages: Sequence[float] | np.ndarray,
    max_seq_len: int,
    pad_id: int,
    *,
    temperature: float | Sequence[float] | np.ndarray = 1.0,
    batch_size: int | None = None,
) -> TrainingBatch:
    """Build a :class:`TrainingBatch` from rollouts and one advantage per rollout.

    Args:
        rollouts: the rollouts, in batch order.
        advantages: one float per rollout (from ``RLLossModule.compute_advantages``), spread
            over that rollout's response tokens.
        max_seq_len: the row length; longer rollouts lose the end of their response.
        pad_id: the token id that fills the rest of a row (always masked out).
        temperature: the sampling temperature of the rollouts: one for all, or one per rollout
            (a batch may mix lessons sampled at different temperatures). Padding rows get 1.
        batch_size: pad the batch with empty rows (all-zero mask) up to this many, so that a
            jitted step sees one shape; ``None`` uses ``len(rollouts)``.
    """
    advantages = np.asarray(advantages, dtype=np.float32).reshape(-1)
    if advantages.shape[0] != len(rollouts):
        raise ValueError(f"{advantages.shape[0]} advantages for {len(rollouts)} rollouts")
    n = len(rollouts) if batch_size is None else batch_size
    if n < len(rollouts):
        raise ValueError(f"batch_size={batch_size} is smaller than the {len(rollouts)} rollouts")
    packed = pack_sequences(
        [r.prompt_tokens for r in rollouts],
        [r.response_tokens for r in rollouts],
        max_seq_len=max_seq_len,
        pad_id=pad_id,
    )
    input_ids = np.full((n, max_seq_len), pad_id, dtype=np.int32)
    input_ids[: len(rollouts)] = packed.input_ids
    loss_mask = np.zeros((n, max_seq_len), dtype=np.float32)
    token_advantages = np.zeros((n, max_seq_len), dtype=np.float32)
    behaviour = np.zeros((n, max_seq_len), dtype=np.float32)
    for i, rollout in enumerate(rollouts):
        start, length = int(packed.response_starts[i]), int(packed.response_lengths[i])
        predicting = slice(start - 1, start - 1 + length)
        loss_mask[i, predicting] = 1.0
        token_advantages[i, predicting] = advantages[i]
        behaviour[i, predicting] = rollout.response_logprobs[:length]
    temps = np.ones((n,), dtype=np.float32)
    given = np.asarray(temperature, dtype=np.float32)
    if given.ndim == 0:
        temps[:] = given
    elif given.shape != (len(rollouts),):
        raise ValueError(f"{given.shape[0]} temperatures for {len(rollouts)} rollouts")
    else:
        temps[: len(rollouts)] = given
    axes = (Axis(BATCH, n), Axis(POS, max_seq_len))
    return TrainingBatch(
        input_ids=hax.named(jnp.asarray(input_ids), axes),
        loss_mask=hax.named(jnp.asarray(loss_mask), axes),
        advantages=hax.named(jnp.asarray(token_advantages), axes),
        behaviour_logprobs=hax.named(jnp.asarray(behaviour), axes),
        temperature=hax.named(jnp.asarray(temps), axes[0]),
    )


__all__ = ["PackedSequences", "TrainingBatch", "pack_sequences", "training_batch_from_rollouts"]
