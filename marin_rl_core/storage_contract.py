"""The contract check of a rollout storage plugin (re-exported by :mod:`marin_rl_core.testing`
as ``check_storage``): what the rollout workers and the trainer rely on, in a round trip through
the storage built with a scratch run directory.

What a check cannot do for any storage (a write that fails half-way and is retried, back-pressure
at the storage's own capacity setting) is for the package's own tests, with failures it injects:
``examples/marinrl-sqlite-storage/tests`` shows how.
"""

from __future__ import annotations

import json
import pickle
import tempfile
import time
from typing import Any

from marin_rl_core import protocols
from marin_rl_core.hookspecs import StoragePlugin
from marin_rl_core.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata, RunInfo

READ_TIMEOUT_S = 30.0
"""How long the check waits for batches written to arrive before it fails."""


def _batch(writer: str, index: int) -> RolloutBatch:
    """A batch whose rollouts say who wrote it and which of its batches it is."""
    return RolloutBatch(
        groups=[
            RolloutGroup(
                rollouts=[
                    Rollout.single_turn(
                        env_name="check",
                        lesson_id="check",
                        problem_id=f"{writer}/{index}",
                        prompt_tokens=[1, 2, 3],
                        response_tokens=[index, k],
                        response_logprobs=[-0.5, -0.25],
                        reward=float(k),
                        metadata=RolloutMetadata(worker_id=writer, timestamp=1.0, weight_step=0),
                    )
                    for k in range(2)
                ]
            )
        ]
    )


def _key(batch: RolloutBatch) -> str:
    return batch.groups[0].rollouts[0].problem_id


def _read(reader: Any, count: int, what: str) -> list[str]:
    """The keys of the next ``count`` batches ``reader`` returns, within :data:`READ_TIMEOUT_S`."""
    got: list[str] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    while len(got) < count and time.monotonic() < deadline:
        batches = reader.read_batches(max_batches=count - len(got), timeout=1.0)
        assert isinstance(batches, list), f"{what}: read_batches must return a list"
        for batch in batches:
            index = int(_key(batch).split("/")[1])
            tokens = [r.response_tokens.tolist() for g in batch.groups for r in g.rollouts]
            assert tokens == [[index, 0], [index, 1]], f"{what}: a batch came back changed"
            got.append(_key(batch))
    assert len(got) >= count, (
        f"{what}: {count} batches written, {len(got)} read within {READ_TIMEOUT_S:.0f} s ({got})"
    )
    return got


def check_storage(record: StoragePlugin, config: Any = None, *, round_trip: bool = True) -> None:
    """Contract of a storage (built with ``config``, default: its config class's defaults, and a
    scratch run directory): it is a :class:`~marin_rl_core.protocols.RolloutStorage` and pickles
    (workers receive a copy); then, unless ``round_trip=False`` (a storage whose service the
    test cannot run):

    * batches written by two writers (made from the pickled copy, as on the workers) arrive at
      the reader, each once, with their rollouts intact, and a reader with nothing new returns
      ``[]``;
    * ``position()`` is JSON-able; ``checkpointed(position)`` does not raise; a reader made from
      that position returns the batches written after it and none before (a resumed trainer);
    * ``trouble()`` is ``""`` while nothing is wrong, and ``close()`` returns.
    """
    from marin_rl_core.config.converter import check_config_class

    name = f"storage {record.name!r}"
    with tempfile.TemporaryDirectory(prefix="marinrl-check-") as run_dir:
        storage = record.build(
            check_config_class(record, config), RunInfo(run_id="check", run_dir=run_dir)
        )
        assert isinstance(storage, protocols.RolloutStorage), (
            f"{name}: build() must return a RolloutStorage (writer, reader, close)"
        )
        try:
            copy = pickle.loads(pickle.dumps(storage))
        except Exception as exc:
            raise AssertionError(
                f"{name}: the storage object must pickle (rollout workers receive a copy): {exc}"
            ) from exc
        if not round_trip:
            return
        try:
            _round_trip(name, storage, copy)
        finally:
            storage.close()


def _round_trip(name: str, storage: Any, copy: Any) -> None:
    writers = [copy.writer(name="check-0"), copy.writer(name="check-1")]
    for w in writers:
        assert isinstance(w, protocols.RolloutWriter), f"{name}: writer() must be a RolloutWriter"
    sent = [("check-0", 0), ("check-1", 0), ("check-0", 1)]
    for writer, index in sent:
        writers[int(writer[-1])].write_batch(_batch(writer, index), timeout=READ_TIMEOUT_S)

    reader = storage.reader(None)
    assert isinstance(reader, protocols.RolloutReader), f"{name}: reader() must be a RolloutReader"
    got = _read(reader, len(sent), name)
    want = [f"{w}/{i}" for w, i in sent]
    assert sorted(got) == sorted(want), f"{name}: wrote {want}, read {got} (each exactly once)"
    assert got.index("check-0/0") < got.index("check-0/1"), f"{name}: a writer's order is kept"
    assert reader.read_batches(max_batches=8, timeout=0.5) == [], (
        f"{name}: every batch was read; another read must return [] (a batch delivered twice)"
    )
    assert reader.trouble() == "", f"{name}: trouble() with nothing wrong: {reader.trouble()!r}"

    position = reader.position()
    try:
        position = json.loads(json.dumps(position))
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"{name}: position() must be JSON-able, got {position!r}") from exc
    reader.checkpointed(position)
    writers[1].write_batch(_batch("check-1", 1), timeout=READ_TIMEOUT_S)
    resumed = storage.reader(position)
    again = _read(resumed, 1, f"{name}, a reader resumed at {position!r}")
    assert again == ["check-1/1"], (
        f"{name}: a reader resumed at {position!r} returned {again}, want ['check-1/1'] (the "
        "batch written after that position; a resumed trainer would train on the others twice)"
    )
    assert resumed.read_batches(max_batches=8, timeout=0.5) == [], (
        f"{name}: a reader resumed at {position!r} returned a batch read before that position"
    )


__all__ = ["READ_TIMEOUT_S", "check_storage"]
