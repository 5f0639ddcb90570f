"""The example storage's own tests, as its author runs them (pytest in this directory, the package
installed): marinrl's contract check, and the storage contract's promises on a real file."""

from __future__ import annotations

import json
import pickle
import time

import marinrl_sqlite_storage
import pytest

from marin_rl_core import (
    Rollout,
    RolloutBatch,
    RolloutGroup,
    RolloutMetadata,
    RunInfo,
    serialize_rollout_batch,
)
from marin_rl_core.testing import check_plugin


def make_batch(index: int) -> RolloutBatch:
    meta = RolloutMetadata(worker_id="w0", timestamp=1.0, weight_step=0, batch_index=index)
    rollout = Rollout.single_turn(
        env_name="e", lesson_id="l", problem_id=f"p{index}", prompt_tokens=[1, 2],
        response_tokens=[3, index], response_logprobs=[-0.5, -1.5], reward=float(index),
    ).with_metadata(meta)  # fmt: skip
    return RolloutBatch(groups=[RolloutGroup(rollouts=[rollout])])


def problems(batches: list[RolloutBatch]) -> list[str]:
    return [r.problem_id for b in batches for r in b.rollouts]


def in_another_process(storage):
    """What a Ray worker gets: the storage pickled and unpickled (a handle, no connection)."""
    return pickle.loads(pickle.dumps(storage))


@pytest.fixture
def storage(tmp_path):
    config = marinrl_sqlite_storage.SqliteStorageConfig(max_unread_batches=3)
    return marinrl_sqlite_storage.build(config, RunInfo(run_id="r", run_dir=str(tmp_path)))


def test_the_plugin_honours_the_storage_contract(plugin_registry):
    registry = plugin_registry(marinrl_sqlite_storage)
    assert registry.names("storage") == ["sqlite"]
    check_plugin(registry.get("storage", "sqlite"))


def test_batches_come_back_whole_in_the_order_they_were_written(storage):
    written = [make_batch(i) for i in range(3)]
    one, two = in_another_process(storage).writer(name="a"), storage.writer(name="b")
    one.write_batch(written[0], timeout=1)
    two.write_batch(written[1], timeout=1)
    one.write_batch(written[2], timeout=1)
    reader = in_another_process(storage).reader()
    got = reader.read_batches(max_batches=10)
    assert [serialize_rollout_batch(b) for b in got] == [
        serialize_rollout_batch(b) for b in written
    ]
    assert reader.read_batches(max_batches=10, timeout=0.1) == []
    assert reader.trouble() == ""


def test_a_batch_written_again_after_an_error_is_delivered_once(storage):
    writer, reader = storage.writer(), storage.reader()
    writer.write_batch(make_batch(0))
    writer.write_batch(make_batch(0))  # the worker's retry: it cannot know the first one landed
    assert problems(reader.read_batches(max_batches=10)) == ["p0"]
    reader.checkpointed(reader.position())  # its data is forgotten, its key is not
    in_another_process(storage).writer().write_batch(make_batch(0))
    writer.write_batch(make_batch(1))
    assert problems(reader.read_batches(max_batches=10)) == ["p1"]


def test_a_resumed_reader_returns_only_the_batches_after_its_position(storage):
    writer, reader = storage.writer(), storage.reader()
    for i in range(2):
        writer.write_batch(make_batch(i))
    assert problems(reader.read_batches(max_batches=10)) == ["p0", "p1"]
    saved = json.loads(json.dumps(reader.position()))  # as the checkpoint keeps it
    writer.write_batch(make_batch(2))
    assert problems(reader.read_batches(max_batches=10)) == ["p2"]  # read, but not checkpointed
    writer.write_batch(make_batch(3))

    resumed = in_another_process(storage).reader(saved)
    assert problems(resumed.read_batches(max_batches=10)) == ["p2", "p3"]
    # A position of some other storage starts from the start.
    other = storage.reader({"queue": "marinrl-rollouts-1", "after": 3})
    assert problems(other.read_batches(max_batches=10)) == ["p0", "p1", "p2", "p3"]


def test_a_full_storage_makes_the_writer_wait_then_time_out_with_the_batch_not_stored(storage):
    writer, reader = storage.writer(), storage.reader()
    for i in range(3):  # max_unread_batches
        writer.write_batch(make_batch(i), timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still unread"):
        writer.write_batch(make_batch(3), timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert problems(reader.read_batches(max_batches=2)) == ["p0", "p1"]  # room for two
    writer.write_batch(make_batch(4), timeout=1)
    writer.write_batch(make_batch(5), timeout=1)
    assert problems(reader.read_batches(max_batches=10)) == ["p2", "p4", "p5"]  # not p3
