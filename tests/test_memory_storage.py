"""The ``memory`` storage with a real local Ray: order, back-pressure, exactly-once delivery."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from marin_rl_plugins import memory_storage  # noqa: E402
from marin_rl_plugins.memory_storage import MemoryStorageConfig  # noqa: E402

from marin_rl_core import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata, RunInfo  # noqa: E402
from marin_rl_core.registry import build_registry  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(start_local_ray):
    import sys

    from ray import cloudpickle

    # Ray workers cannot import this test module by name: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    local = start_local_ray(2)
    yield
    local.stop()


@pytest.fixture
def make_storage():
    made = []

    def make(**config):
        registry = build_registry(autoload=False, modules=[memory_storage])
        record = registry.get("storage", "memory")
        storage = record.build(record.config_class(**config), RunInfo(run_id="t", run_dir="."))
        made.append(storage)
        return storage

    yield make
    for storage in made:
        storage.close()


def make_batch(writer: str, index: int, *, group_sizes=(2, 1), timestamp=1.0) -> RolloutBatch:
    """A batch whose rollouts say who wrote it and its position in that writer's sequence."""
    groups = []
    for g, size in enumerate(group_sizes):
        groups.append(
            RolloutGroup(
                rollouts=[
                    Rollout.single_turn(
                        env_name="env",
                        lesson_id="lesson",
                        problem_id=f"{writer}/{index}/{g}",
                        prompt_tokens=[1, 2, 3],
                        response_tokens=[index, k],
                        response_logprobs=[-0.5, -0.25],
                        reward=float(k),
                        metadata=RolloutMetadata(
                            worker_id=writer, timestamp=timestamp, weight_step=0
                        ),
                    )
                    for k in range(size)
                ]
            )
        )
    return RolloutBatch(groups=groups)


def batch_key(batch: RolloutBatch) -> tuple[str, int]:
    writer, index, _ = batch.groups[0].rollouts[0].problem_id.split("/")
    return writer, int(index)


def test_batches_arrive_in_writer_order_through_a_pickled_handle(make_storage):
    storage = make_storage(capacity=16)
    remote_copy = pickle.loads(pickle.dumps(storage))  # what a Ray worker receives
    writer = remote_copy.writer()
    for i in range(10):
        writer.write_batch(make_batch("w", i), timeout=5)

    reader = storage.reader()
    got = reader.read_batches(max_batches=4, timeout=1)
    got += reader.read_batches(max_batches=100, timeout=1)
    assert [batch_key(b) for b in got] == [("w", i) for i in range(10)]
    assert [len(g.rollouts) for g in got[3].groups] == [2, 1]
    assert got[3].groups[0].rollouts[1].response_tokens.tolist() == [3, 1]
    assert reader.read_batches(max_batches=10, timeout=0.05) == []


def test_writer_blocks_while_full_until_the_reader_drains(make_storage):
    storage = make_storage(capacity=2)
    writer, reader = storage.writer(), storage.reader()
    writer.write_batch(make_batch("w", 0))
    writer.write_batch(make_batch("w", 1))

    done = threading.Event()

    def third_write():
        writer.write_batch(make_batch("w", 2), timeout=None)
        done.set()

    thread = threading.Thread(target=third_write, daemon=True)
    thread.start()
    assert not done.wait(0.5), "a write into a full queue returned without waiting"
    assert storage.stats()["queued_batches"] == 2

    first = reader.read_batches(max_batches=1)
    assert [batch_key(b) for b in first] == [("w", 0)]
    assert done.wait(10), "the blocked writer did not resume after the reader drained"
    thread.join(5)
    rest = reader.read_batches(max_batches=10, timeout=1)
    assert [batch_key(b) for b in rest] == [("w", 1), ("w", 2)]


def test_full_queue_times_out_with_a_helpful_error_and_stores_nothing(make_storage):
    storage = make_storage(capacity=1)
    writer, reader = storage.writer(), storage.reader()
    writer.write_batch(make_batch("w", 0), timeout=0)
    with pytest.raises(TimeoutError) as info:
        writer.write_batch(make_batch("w", 1), timeout=0.2)
    message = str(info.value)
    assert storage.queue_name in message and "capacity 1 batches" in message
    assert "0.2 s" in message and "not stored" in message and "Raise [storage] capacity" in message

    assert [batch_key(b) for b in reader.read_batches(max_batches=10, timeout=1)] == [("w", 0)]
    writer.write_batch(make_batch("w", 1), timeout=1)  # the same writer carries on afterwards
    assert [batch_key(b) for b in reader.read_batches(max_batches=10, timeout=1)] == [("w", 1)]
    assert storage.stats()["write_timeouts"] == 1


def test_a_repeated_put_is_not_stored_twice(make_storage):
    storage = make_storage(capacity=4)
    queue = storage._queue_actor()
    assert ray.get(queue.put.remote("writer-a", 0, b"x", 1.0)) == "accepted"
    assert ray.get(queue.put.remote("writer-a", 0, b"x", 1.0)) == "duplicate"
    assert ray.get(queue.put.remote("writer-a", 1, b"y", 1.0)) == "accepted"
    assert ray.get(queue.take.remote(0, 10, 0.0)) == [(1, b"x"), (2, b"y")]


@ray.remote(num_cpus=0)
class WriterActor:
    def write(self, storage, name: str, n: int) -> int:
        writer = storage.writer()
        for i in range(n):
            writer.write_batch(make_batch(name, i, group_sizes=(1 + i % 3,)), timeout=60)
        return n


def test_concurrent_writers_deliver_every_batch_exactly_once(make_storage):
    storage = make_storage(capacity=3)  # small, so writers hit back-pressure all the time
    n_writers, n_batches = 3, 25
    actors = [WriterActor.remote() for _ in range(n_writers)]
    pending = [a.write.remote(storage, f"w{k}", n_batches) for k, a in enumerate(actors)]

    reader = storage.reader()
    received = []
    deadline = time.monotonic() + 60
    while len(received) < n_writers * n_batches and time.monotonic() < deadline:
        received += reader.read_batches(max_batches=2, timeout=1)
    assert ray.get(pending, timeout=30) == [n_batches] * n_writers
    received += reader.read_batches(max_batches=100, timeout=0.2)

    keys = [batch_key(b) for b in received]
    assert len(keys) == len(set(keys)) == n_writers * n_batches
    for k in range(n_writers):
        assert [i for w, i in keys if w == f"w{k}"] == list(range(n_batches))
    stats = storage.stats()
    assert stats["accepted_batches"] == stats["taken_batches"] == n_writers * n_batches
    for actor in actors:
        ray.kill(actor)


class LostReply:
    """A queue handle whose ``put`` reaches the queue but whose reply is lost, once."""

    def __init__(self, queue):
        self._queue, self.lost = queue, 0

    def __getattr__(self, name):
        return getattr(self._queue, name)

    @property
    def put(self):
        outer = self

        class Put:
            @staticmethod
            def remote(*args):
                ref = outer._queue.put.remote(*args)
                if outer.lost:
                    return ref
                ray.get(ref)  # the queue took it ...
                outer.lost += 1
                raise ConnectionError("reply lost")  # ... but the writer never hears so

        return Put


def test_a_retried_write_after_a_lost_reply_is_stored_once(make_storage):
    storage = make_storage(capacity=4)
    writer, reader = storage.writer(), storage.reader()
    writer._queue = LostReply(writer._queue)
    batch = make_batch("w", 0)
    with pytest.raises(ConnectionError):
        writer.write_batch(batch, timeout=1)
    writer.write_batch(batch, timeout=1)  # the caller retries the same batch
    writer.write_batch(make_batch("w", 1), timeout=1)
    keys = [batch_key(b) for b in reader.read_batches(max_batches=10, timeout=1)]
    assert keys == [("w", 0), ("w", 1)]
    assert storage.stats()["duplicate_writes"] == 1


def test_a_failed_read_loses_nothing_and_the_next_read_gets_the_same_batches(
    make_storage, monkeypatch
):
    storage = make_storage(capacity=4)
    writer, reader = storage.writer(), storage.reader()
    for i in range(3):
        writer.write_batch(make_batch("w", i), timeout=1)

    def broken(data):
        raise OSError("the read failed half way")

    with monkeypatch.context() as patch:
        patch.setattr("marin_rl_core.deserialize_rollout_batch", broken)  # what plugins call
        with pytest.raises(OSError):
            reader.read_batches(max_batches=2, timeout=1)
    first = reader.read_batches(max_batches=2, timeout=1)
    rest = reader.read_batches(max_batches=10, timeout=1)
    assert [batch_key(b) for b in first + rest] == [("w", 0), ("w", 1), ("w", 2)]
    assert reader.read_batches(max_batches=10, timeout=0.05) == []
    stats = storage.stats()
    assert stats["redelivered_batches"] == 2 and stats["acknowledged_batches"] == 3


def test_config_rejects_a_zero_capacity():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        MemoryStorageConfig(capacity=0)


def test_a_reader_started_again_from_its_position_goes_on_after_it(make_storage):
    """What a resumed trainer does: a new reader from the saved (JSON) position returns only
    the batches after it; a position of another job's queue starts from the start."""
    import json

    storage = make_storage(capacity=16)
    writer = storage.writer(name="rollout-0")
    for i in range(5):
        writer.write_batch(make_batch("w", i), timeout=5)
    first = storage.reader()
    assert [batch_key(b) for b in first.read_batches(max_batches=3, timeout=1)] == [
        ("w", 0), ("w", 1), ("w", 2)
    ]  # fmt: skip
    saved = json.loads(json.dumps(first.position()))
    first.checkpointed(saved)
    again = storage.reader(saved)
    assert [batch_key(b) for b in again.read_batches(max_batches=10, timeout=1)] == [
        ("w", 3), ("w", 4)
    ]  # fmt: skip
    other = make_storage(capacity=4)
    other.writer().write_batch(make_batch("v", 0), timeout=5)
    assert [batch_key(b) for b in other.reader(saved).read_batches(max_batches=10, timeout=1)] == [
        ("v", 0)
    ]  # fmt: skip


def trainer_config(*, batch_size: int):
    """The registry and an rloo config of the mock env, trained on pairs of rollouts."""
    from marin_rl_core.config import resolve_config

    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "mock", "loss": "rloo"},
        overrides=[f"trainer.batch_size={batch_size}", "sampling.n_generations_per_prompt=2"],
    )
    return registry, config


def test_a_resumed_trainer_reads_on_after_the_batches_its_checkpoint_holds(make_storage, tmp_path):
    """Exactly once across a trainer restart: batches read before the checkpoint come back in
    its replay buffer and are not read again; the ones after it are read once."""
    from marin_rl_core.learner.trainer import Trainer

    registry, config = trainer_config(batch_size=6)
    storage = make_storage(capacity=16)
    writer = storage.writer(name="rollout-0")
    for i in range(3):
        writer.write_batch(make_batch("w", i, group_sizes=(2, 2), timestamp=time.time()), timeout=5)
    first = Trainer(config, registry, run_dir=tmp_path, storage=storage)
    read = first.reader.read_batches(max_batches=2, timeout=1)
    first.replay.add_batches(read, current_step=0)
    held = len(first.replay)
    assert held == 8
    first.checkpoint()
    del first
    writer.write_batch(make_batch("w", 3, group_sizes=(2, 2), timestamp=time.time()), timeout=5)
    resumed = Trainer(config, registry, run_dir=tmp_path, storage=storage)
    assert len(resumed.replay) == held
    later = resumed.reader.read_batches(max_batches=10, timeout=1)
    assert [batch_key(b) for b in later] == [("w", 2), ("w", 3)]


def test_a_trainer_with_a_batch_in_hand_is_not_starved_while_its_first_step_compiles(
    make_storage, tmp_path
):
    """A paced worker asks the trainer whether it is short of rollouts: one that has its batch
    and waits for its first step's compile (a slow one on a loaded machine) is not, else the
    worker made a batch with the old weights that arrived stale (32 dropped in test_job)."""
    from marin_rl_core.learner.trainer import Trainer

    class Compiled(Exception):
        pass

    registry, config = trainer_config(batch_size=4)
    storage = make_storage(capacity=4)
    storage.writer(name="rollout-0").write_batch(
        make_batch("w", 0, group_sizes=(2, 2), timestamp=time.time()), timeout=5
    )
    trainer = Trainer(config, registry, run_dir=tmp_path, storage=storage)
    seen = []

    class SlowCompile:
        cancelled = threading.Event()

        def finish(self) -> None:  # the batch is read; the step's tracing is not done
            time.sleep(0.05)
            seen.append((trainer.starved_seconds(), trainer.diagnostics()["stage"]))
            raise Compiled

    trainer.updates.start_warm_up = lambda *a, **k: SlowCompile()
    with pytest.raises(Compiled):
        trainer.run()
    assert seen == [(0.0, "starting a training step")]
    assert trainer.rollouts_read == 4
