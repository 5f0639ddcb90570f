"""Rollout batches as Arrow IPC bytes: the one wire format of rollout storage.

A batch becomes an Arrow stream with one row per rollout, in group order::

    env_name string, lesson_id string, problem_id string, group int32,
    tokens list<int32>, loss_mask list<bool>, logprobs list<float32>, reward float64,
    turn_starts list<int32>, turn_rewards list<float32>, token_rewards list<float32>,
    part int32, truncated bool,
    worker_id string?, timestamp float64?, weight_step int64?   (null when metadata is None)
    worker_index int64?, batch_index int64?                     (null when not known)
    last_weight_step int64?                                     (null: weight_step sampled all)
    reward_terms map<string, float64>                           (empty without reward terms)

The schema's metadata carries the format name, :data:`FORMAT_VERSION` and the number of groups
(so groups without rollouts survive the round trip). Decoding checks the schema exactly and
validates every buffer before reading; nothing is unpickled, so bytes from another process or a
file can be decoded safely. Round trips are exact: token ids, float32 logprobs, float64 rewards
and timestamps come back bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from marin_rl_core.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

FORMAT_NAME = b"marinrl.rollout_batch"
FORMAT_VERSION = 5
"""Bump when the schema changes; decoders refuse versions they do not know. Version 3: token-exact
multi-turn rollouts (one token row with a loss mask, turn starts and rewards). Version 4 adds
``last_weight_step`` (rollouts sampled across a weight swap), version 5 ``reward_terms`` (each
term of a combined reward); versions 3 and 4 are still read (a run resumed from rollouts stored
before)."""
_READ_VERSIONS = (3, 4, 5)

_KEY_FORMAT = b"marinrl.format"
_KEY_VERSION = b"marinrl.format_version"
_KEY_NUM_GROUPS = b"marinrl.num_groups"

_FIELDS = [
    pa.field("env_name", pa.string(), nullable=False),
    pa.field("lesson_id", pa.string(), nullable=False),
    pa.field("problem_id", pa.string(), nullable=False),
    pa.field("group", pa.int32(), nullable=False),
    pa.field("tokens", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("turn_starts", pa.list_(pa.int32()), nullable=False),
    pa.field("turn_rewards", pa.list_(pa.float32()), nullable=False),
    pa.field("token_rewards", pa.list_(pa.float32()), nullable=False),
    pa.field("part", pa.int32(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("worker_id", pa.string()),
    pa.field("timestamp", pa.float64()),
    pa.field("weight_step", pa.int64()),
    pa.field("worker_index", pa.int64()),
    pa.field("batch_index", pa.int64()),
    pa.field("last_weight_step", pa.int64()),
    pa.field("reward_terms", pa.map_(pa.string(), pa.float64()), nullable=False),
]
ROLLOUT_SCHEMA = pa.schema(_FIELDS)
"""The row schema (without the per-batch schema metadata)."""
_SCHEMAS = {"3": pa.schema(_FIELDS[:-2]), "4": pa.schema(_FIELDS[:-1]), "5": ROLLOUT_SCHEMA}

_REQUIRED = [f.name for f in _FIELDS if not f.nullable]
_METADATA_COLUMNS = ("worker_id", "timestamp", "weight_step")


class RolloutDecodeError(ValueError):
    """Bytes that are not a rollout batch this version of marinrl can read."""


def _list_array(rows: list[np.ndarray], dtype: Any, arrow_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=arrow_type))


def rollout_batch_to_table(batch: RolloutBatch) -> pa.Table:
    """``batch`` as an Arrow table in :data:`ROLLOUT_SCHEMA`, with the format metadata."""
    rollouts: list[Rollout] = []
    group_index: list[int] = []
    for g, group in enumerate(batch.groups):
        rollouts.extend(group.rollouts)
        group_index.extend([g] * len(group.rollouts))
    meta = [r.metadata for r in rollouts]
    columns = [
        pa.array([r.env_name for r in rollouts], pa.string()),
        pa.array([r.lesson_id for r in rollouts], pa.string()),
        pa.array([r.problem_id for r in rollouts], pa.string()),
        pa.array(np.asarray(group_index, dtype=np.int32), pa.int32()),
        _list_array([r.tokens for r in rollouts], np.int32, pa.int32()),
        _list_array([r.loss_mask for r in rollouts], np.bool_, pa.bool_()),
        _list_array([r.logprobs for r in rollouts], np.float32, pa.float32()),
        pa.array(np.asarray([r.reward for r in rollouts], dtype=np.float64), pa.float64()),
        _list_array([r.turn_starts for r in rollouts], np.int32, pa.int32()),
        _list_array([r.turn_rewards for r in rollouts], np.float32, pa.float32()),
        _list_array([r.token_rewards for r in rollouts], np.float32, pa.float32()),
        pa.array(np.asarray([r.part for r in rollouts], dtype=np.int32), pa.int32()),
        pa.array([bool(r.truncated) for r in rollouts], pa.bool_()),
        pa.array([m.worker_id if m else None for m in meta], pa.string()),
        pa.array([float(m.timestamp) if m else None for m in meta], pa.float64()),
        pa.array([int(m.weight_step) if m else None for m in meta], pa.int64()),
        pa.array([m.worker_index if m else None for m in meta], pa.int64()),
        pa.array([m.batch_index if m else None for m in meta], pa.int64()),
        pa.array([m.last_weight_step if m else None for m in meta], pa.int64()),
        pa.array(
            [list(r.reward_terms.items()) for r in rollouts], pa.map_(pa.string(), pa.float64())
        ),
    ]
    schema = ROLLOUT_SCHEMA.with_metadata(
        {
            _KEY_FORMAT: FORMAT_NAME,
            _KEY_VERSION: str(FORMAT_VERSION).encode(),
            _KEY_NUM_GROUPS: str(len(batch.groups)).encode(),
        }
    )
    return pa.Table.from_arrays(columns, schema=schema)


def serialize_rollout_batch(batch: RolloutBatch) -> bytes:
    """Encode ``batch`` as Arrow IPC stream bytes (see the module docstring for the schema)."""
    table = rollout_batch_to_table(batch)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _check_schema(schema: pa.Schema) -> int:
    """Validate the format metadata and columns; return the number of groups."""
    meta = schema.metadata or {}
    if meta.get(_KEY_FORMAT) != FORMAT_NAME:
        raise RolloutDecodeError(
            f"not a marinrl rollout batch: schema metadata {_KEY_FORMAT.decode()!r} is "
            f"{meta.get(_KEY_FORMAT)!r}, expected {FORMAT_NAME.decode()!r}"
        )
    version = meta.get(_KEY_VERSION, b"?").decode(errors="replace")
    if version not in {str(v) for v in _READ_VERSIONS}:
        raise RolloutDecodeError(
            f"rollout batch format version {version!r} is not supported (this marinrl reads "
            f"versions {', '.join(map(str, _READ_VERSIONS))}); run the writer and reader with "
            "the same marinrl version"
        )
    try:
        num_groups = int(meta.get(_KEY_NUM_GROUPS, b""))
    except ValueError:
        num_groups = -1
    if num_groups < 0:
        raise RolloutDecodeError(
            f"rollout batch has a malformed {_KEY_NUM_GROUPS.decode()!r}: "
            f"{meta.get(_KEY_NUM_GROUPS)!r}"
        )
    got = [(f.name, f.type) for f in schema]
    want = [(f.name, f.type) for f in _SCHEMAS[version]]
    if got != want:
        raise RolloutDecodeError(
            "rollout batch columns do not match the expected schema:\n"
            f"  got:      {', '.join(f'{n}: {t}' for n, t in got)}\n"
            f"  expected: {', '.join(f'{n}: {t}' for n, t in want)}"
        )
    return num_groups


def _split_lists(column: pa.ChunkedArray, dtype: Any) -> list[np.ndarray]:
    """Each row of a list column as its own array: views of one copy of the column's values
    (the batch's rollouts share it instead of pinning the whole IPC buffer; one copy and
    slices cost a sixth of a copy per row, which the trainer pays on its critical path)."""
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy(zero_copy_only=False)  # absolute, slice included
    start, end = int(offsets[0]), int(offsets[-1])
    values = np.array(array.values[start:end].to_numpy(zero_copy_only=False), dtype=dtype)
    bounds = (offsets - start).tolist()
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def table_to_rollout_batch(table: pa.Table) -> RolloutBatch:
    """The inverse of :func:`rollout_batch_to_table`; raises :class:`RolloutDecodeError`."""
    num_groups = _check_schema(table.schema)
    for name in _REQUIRED:
        if name in table.column_names and table.column(name).null_count:
            raise RolloutDecodeError(f"rollout batch column {name!r} has null entries")
    if table.num_rows == 0:
        return RolloutBatch(groups=[RolloutGroup(rollouts=()) for _ in range(num_groups)])

    group = table.column("group").to_numpy()
    if group.min() < 0 or group.max() >= num_groups or np.any(np.diff(group) < 0):
        raise RolloutDecodeError(
            f"rollout batch group indices must be non-decreasing and within [0, {num_groups}); "
            f"got values in [{group.min()}, {group.max()}]"
        )
    meta_nulls = np.stack(
        [table.column(c).is_null().to_numpy(zero_copy_only=False) for c in _METADATA_COLUMNS]
    )
    if np.any(meta_nulls.any(axis=0) != meta_nulls.all(axis=0)):
        raise RolloutDecodeError(
            "rollout batch has partial metadata: worker_id, timestamp and weight_step must be "
            "all set or all null in each row"
        )

    env = table.column("env_name").to_pylist()
    lesson = table.column("lesson_id").to_pylist()
    problem = table.column("problem_id").to_pylist()
    tokens = _split_lists(table.column("tokens"), np.int32)
    loss_mask = _split_lists(table.column("loss_mask"), np.bool_)
    logprobs = _split_lists(table.column("logprobs"), np.float32)
    reward = table.column("reward").to_numpy()
    turn_starts = _split_lists(table.column("turn_starts"), np.int32)
    turn_rewards = _split_lists(table.column("turn_rewards"), np.float32)
    token_rewards = _split_lists(table.column("token_rewards"), np.float32)
    part = table.column("part").to_numpy()
    truncated = table.column("truncated").to_pylist()
    worker = table.column("worker_id").to_pylist()
    timestamp = table.column("timestamp").to_pylist()
    weight_step = table.column("weight_step").to_pylist()
    worker_index = table.column("worker_index").to_pylist()
    batch_index = table.column("batch_index").to_pylist()
    last_weight_step = (
        table.column("last_weight_step").to_pylist()
        if "last_weight_step" in table.column_names
        else [None] * table.num_rows
    )

    reward_terms = (
        table.column("reward_terms").to_pylist()
        if "reward_terms" in table.column_names
        else [[]] * table.num_rows
    )

    groups: list[list[Rollout]] = [[] for _ in range(num_groups)]
    for i in range(table.num_rows):
        metadata = None
        if worker[i] is not None:
            metadata = RolloutMetadata(
                worker_id=worker[i],
                timestamp=timestamp[i],
                weight_step=weight_step[i],
                worker_index=worker_index[i],
                batch_index=batch_index[i],
                last_weight_step=last_weight_step[i],
            )
        try:
            rollout = Rollout(
                env_name=env[i],
                lesson_id=lesson[i],
                problem_id=problem[i],
                tokens=tokens[i],
                loss_mask=loss_mask[i],
                logprobs=logprobs[i],
                reward=float(reward[i]),
                turn_starts=turn_starts[i],
                turn_rewards=turn_rewards[i],
                token_rewards=token_rewards[i],
                part=int(part[i]),
                truncated=truncated[i],
                reward_terms=dict(reward_terms[i]),
                metadata=metadata,
            )
        except ValueError as exc:
            raise RolloutDecodeError(f"rollout batch row {i} is invalid: {exc}") from exc
        groups[int(group[i])].append(rollout)
    return RolloutBatch(groups=[RolloutGroup(rollouts=g) for g in groups])


def deserialize_rollout_batch(data: bytes | bytearray | memoryview | pa.Buffer) -> RolloutBatch:
    """Decode bytes made by :func:`serialize_rollout_batch`.

    Raises:
        RolloutDecodeError: the bytes are not an Arrow IPC stream, are corrupt, have another
            schema or format version, or hold inconsistent rows.
    """
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(data))
        table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise RolloutDecodeError(
            f"could not decode rollout batch ({len(memoryview(data))} bytes): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return table_to_rollout_batch(table)
