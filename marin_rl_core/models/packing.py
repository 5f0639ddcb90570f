"""Token sequences laid out in rows: the packing every side shares (the sampler's row widths, the
trainer's batches, log-probabilities of (prompt, response) pairs), and the axis names of those
rows."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

BATCH = "batch"
POS = "position"
VOCAB = "vocab"


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


def pack_rows(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Which sequences share a row: first-fit decreasing of ``lengths`` (each at most
    ``max_seq_len``) into rows of ``max_seq_len`` tokens. Returns each row's indices in
    ascending order; rows in order of their first index."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = min(int(lengths[i]), max_seq_len)
        for r, left in enumerate(room):
            if length <= left:
                rows[r].append(i)
                room[r] -= length
                break
        else:
            rows.append([i])
            room.append(max_seq_len - length)
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])


def row_length(longest: int, max_seq_len: int) -> int:
    """The length of a trimmed batch's rows: its ``longest`` row rounded up to a power of two,
    at least 8 and at most ``max_seq_len``, so that few distinct shapes ever compile (at most
    ``log2(max_seq_len / 8) + 2``)."""
    width = 8
    while width < longest:
        width *= 2
    return min(width, max_seq_len)


__all__ = ["BATCH", "POS", "VOCAB", "PackedSequences", "pack_rows", "pack_sequences", "row_length"]
