"""Rollout batches survive the Arrow IPC round trip exactly, and bad bytes fail clearly."""

from __future__ import annotations

import pickle

import attrs
import numpy as np
import pyarrow as pa
import pytest

from marin_rl_core import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata
from marin_rl_core.rollout_serialization import (
    FORMAT_VERSION,
    RolloutDecodeError,
    deserialize_rollout_batch,
    rollout_batch_to_table,
    serialize_rollout_batch,
)


def make_rollout(i: int, *, n_prompt: int = 3, n_response: int = 4, metadata: bool = True):
    rng = np.random.default_rng(i)
    rollout = Rollout.single_turn(
        env_name=f"env{i % 2}",
        lesson_id=f"lesson-{i % 3}",
        problem_id=f"p{i}-ünïcode",
        prompt_tokens=rng.integers(-(2**31), 2**31 - 1, n_prompt, dtype=np.int32),
        response_tokens=rng.integers(0, 50_000, n_response, dtype=np.int32),
        response_logprobs=rng.standard_normal(n_response).astype(np.float32) * 1e-3 - 3.0,
        reward=float(rng.standard_normal()) / 3.0,  # not representable in float32
        truncated=bool(i % 2),
        metadata=RolloutMetadata(
            worker_id=f"worker-{i}",
            timestamp=1.7e9 + i / 7.0,
            weight_step=2**40 + i,
            worker_index=i % 3 if i % 4 else None,  # known or not: both round-trip
            batch_index=2**33 + i if i % 4 else None,
            last_weight_step=2**40 + i + 2 if i % 3 else None,  # spanning a weight swap, or not
        )
        if metadata
        else None,
    )
    if i % 3 == 1:  # a combined reward's terms (issue 62), or none
        terms = {"correct": 1.0, "brevity-ünï": float(rng.standard_normal()) / 3.0}
        rollout = attrs.evolve(rollout, reward_terms=terms)
    return rollout


def assert_same_rollout(a: Rollout, b: Rollout) -> None:
    assert (a.env_name, a.lesson_id, a.problem_id) == (b.env_name, b.lesson_id, b.problem_id)
    for name in ("tokens", "loss_mask", "logprobs", "turn_starts", "turn_rewards", "token_rewards"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name  # bit-exact, NaN-safe
    assert a.part == b.part and type(b.part) is int
    assert a.reward == b.reward and type(b.reward) is float
    assert a.truncated == b.truncated and type(b.truncated) is bool
    assert a.metadata == b.metadata
    assert a.reward_terms == b.reward_terms and list(a.reward_terms) == list(b.reward_terms)


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    assert [len(g.rollouts) for g in a.groups] == [len(g.rollouts) for g in b.groups]
    for ga, gb in zip(a.groups, b.groups, strict=True):
        for ra, rb in zip(ga.rollouts, gb.rollouts, strict=True):
            assert_same_rollout(ra, rb)


def test_round_trip_is_exact_with_unequal_and_empty_groups():
    batch = RolloutBatch(
        groups=[
            RolloutGroup(rollouts=[make_rollout(0), make_rollout(1, n_response=0)]),
            RolloutGroup(rollouts=[]),
            RolloutGroup(rollouts=[make_rollout(i, n_prompt=i) for i in range(2, 7)]),
            RolloutGroup(rollouts=[make_rollout(7, metadata=False)]),
            RolloutGroup(rollouts=[]),
        ]
    )
    data = serialize_rollout_batch(batch)
    assert isinstance(data, bytes)
    assert_same_batch(batch, deserialize_rollout_batch(data))


def test_special_float_values_round_trip_bitwise():
    r = make_rollout(0, n_response=4)
    r = Rollout.single_turn(
        env_name="e",
        lesson_id="l",
        problem_id="p",
        prompt_tokens=[7],
        response_tokens=[1, 2, 3, 4],
        response_logprobs=[np.nan, -np.inf, -0.0, np.float32(1e-45)],
        reward=-0.0,
        metadata=r.metadata,
    )
    batch = RolloutBatch(groups=[RolloutGroup(rollouts=[r])])
    back = deserialize_rollout_batch(serialize_rollout_batch(batch)).groups[0].rollouts[0]
    assert_same_rollout(r, back)
    assert np.signbit(back.reward)


def test_multi_turn_rollouts_round_trip_with_turns_parts_and_token_rewards():
    # prompt [1, 2], action [3, 4], observation [5], action [6], observation [7, 8], action [9]
    mask = [0, 0, 1, 1, 0, 1, 0, 0, 1]
    first = Rollout(
        env_name="game",
        lesson_id="guess",
        problem_id="p",
        tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9],
        loss_mask=mask,
        logprobs=np.where(np.asarray(mask, bool), -0.25, 0.0),
        reward=1.0,
        turn_starts=[2, 5, 8],
        turn_rewards=[0.0, 0.0, 1.0],
        token_rewards=np.linspace(0, 1, 9),
        truncated=False,
    )
    second = Rollout(
        env_name="game",
        lesson_id="guess",
        problem_id="p",
        tokens=[1, 2, 10, 11],
        loss_mask=[0, 0, 0, 1],
        logprobs=[0, 0, 0, -1.5],
        reward=1.0,
        turn_starts=[3],
        turn_rewards=[1.0],
        part=1,
    )
    batch = RolloutBatch(groups=[RolloutGroup(rollouts=[first, second])])
    back = deserialize_rollout_batch(serialize_rollout_batch(batch))
    assert_same_batch(batch, back)
    assert back.groups[0].rollouts[0].turn_spans() == [(2, 5), (5, 8), (8, 9)]
    assert back.groups[0].rollouts[1].dense_rewards().tolist() == [0, 0, 0, 1.0]


def test_empty_batch_round_trips():
    back = deserialize_rollout_batch(serialize_rollout_batch(RolloutBatch(groups=[])))
    assert back.groups == ()


def test_table_has_one_row_per_rollout_with_version():
    batch = RolloutBatch(
        groups=[
            RolloutGroup(rollouts=[make_rollout(0), make_rollout(1)]),
            RolloutGroup(rollouts=[make_rollout(2)]),
        ]
    )
    table = rollout_batch_to_table(batch)
    assert table.num_rows == 3
    assert table.column("group").to_pylist() == [0, 0, 1]
    assert table.column("weight_step").to_pylist() == [2**40, 2**40 + 1, 2**40 + 2]
    assert table.schema.metadata[b"marinrl.format_version"] == str(FORMAT_VERSION).encode()


def test_garbage_bytes_raise_a_clear_error():
    with pytest.raises(RolloutDecodeError, match="could not decode rollout batch"):
        deserialize_rollout_batch(b"\x00not arrow at all" * 10)


def test_truncated_bytes_raise_a_clear_error():
    data = serialize_rollout_batch(RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(0)])]))
    with pytest.raises(RolloutDecodeError):
        deserialize_rollout_batch(data[: len(data) // 2])


def test_pickle_bytes_are_refused_not_unpickled():
    batch = RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(0)])])
    with pytest.raises(RolloutDecodeError):
        deserialize_rollout_batch(pickle.dumps(batch))


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_other_arrow_tables_are_refused_with_the_reason():
    with pytest.raises(RolloutDecodeError, match="not a marinrl rollout batch"):
        deserialize_rollout_batch(_ipc(pa.table({"x": [1, 2]})))

    table = rollout_batch_to_table(RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(0)])]))
    meta = dict(table.schema.metadata)
    future = table.replace_schema_metadata({**meta, b"marinrl.format_version": b"99"})
    with pytest.raises(RolloutDecodeError, match="version '99' is not supported"):
        deserialize_rollout_batch(_ipc(future))

    renamed = table.rename_columns(["x" + n for n in table.column_names])
    with pytest.raises(RolloutDecodeError, match="columns do not match"):
        deserialize_rollout_batch(_ipc(renamed.replace_schema_metadata(meta)))

    bad_group = table.set_column(3, "group", pa.array([5], pa.int32()))
    with pytest.raises(RolloutDecodeError, match="group indices"):
        deserialize_rollout_batch(_ipc(bad_group.replace_schema_metadata(meta)))


def test_mismatched_logprobs_row_is_refused():
    table = rollout_batch_to_table(RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(0)])]))
    meta = table.schema.metadata
    bad = table.set_column(
        6, table.schema.field(6), pa.array([[0.5]], pa.list_(pa.float32()))
    ).replace_schema_metadata(meta)
    with pytest.raises(RolloutDecodeError, match="row 0 is invalid"):
        deserialize_rollout_batch(_ipc(bad))


def test_batches_stored_before_last_weight_step_still_read():
    """Version 3 (before rollouts recorded the newest weight step) is still read: a run resumes
    from rollouts an older marinrl stored."""
    batch = RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(i) for i in (0, 3)])])
    table = rollout_batch_to_table(batch)
    meta = {**table.schema.metadata, b"marinrl.format_version": b"3"}
    old = table.drop_columns(["last_weight_step", "reward_terms"]).replace_schema_metadata(meta)
    read = deserialize_rollout_batch(_ipc(old))
    assert [r.metadata.last_weight_step for r in read.rollouts] == [None, None]
    assert [r.metadata.weight_step for r in read.rollouts] == [2**40, 2**40 + 3]
    # A version-3 batch with the new column is not version 3.
    with pytest.raises(RolloutDecodeError, match="columns do not match"):
        deserialize_rollout_batch(_ipc(table.replace_schema_metadata(meta)))


def test_batches_stored_before_reward_terms_still_read():
    """Version 4 (before rollouts kept a combined reward's terms) is still read, with none."""
    batch = RolloutBatch(groups=[RolloutGroup(rollouts=[make_rollout(i) for i in (0, 2)])])
    table = rollout_batch_to_table(batch)
    meta = {**table.schema.metadata, b"marinrl.format_version": b"4"}
    read = deserialize_rollout_batch(
        _ipc(table.drop_columns(["reward_terms"]).replace_schema_metadata(meta))
    )
    assert [r.reward_terms for r in read.rollouts] == [{}, {}]
    assert [r.metadata.last_weight_step for r in read.rollouts] == [None, 2**40 + 4]
