"""The ``gcs`` storage (batches as objects under an fsspec URL) on local paths and ``file://``
URLs: order, exactly once across writer processes and reader restarts, damaged objects,
back-pressure, retention, and a storage that does not answer."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
from marin_rl_plugins.object_storage import (
    ObjectStorageConfig,
    StorageUnavailableError,
    build_object_storage,
)

from marin_rl_core import Rollout, RolloutBatch, RolloutGroup, RunInfo, build_registry
from marin_rl_core.errors import ExitCode

# --- the backends: a local path, and real servers on loopback (conftest.py's `servers`) -------


@pytest.fixture(params=["path", "gs", "s3"])
def backend(request, tmp_path):
    """The ``url`` of a storage: empty (the run directory), or a bucket on a loopback server."""
    if request.param == "path":
        return ""
    return request.getfixturevalue("servers")(request.param) + "/rollouts"


def make_batch(writer: str, index: int) -> RolloutBatch:
    return RolloutBatch(
        groups=[
            RolloutGroup(
                rollouts=[
                    Rollout.single_turn(
                        env_name="env",
                        lesson_id="lesson",
                        problem_id=f"{writer}/{index}/{k}",
                        prompt_tokens=[1, 2, 3],
                        response_tokens=[index % 50, k],
                        response_logprobs=[-0.5, -0.25],
                        reward=float(k),
                    )  # fmt: skip
                    for k in range(2)
                ]
            )
        ]
    )


def key(batch: RolloutBatch) -> tuple[str, int]:
    writer, index, _ = batch.groups[0].rollouts[0].problem_id.split("/")
    return writer, int(index)


def storage_at(tmp_path, url: str = "", **config):
    config.setdefault("poll_interval_s", 0.02)
    config.setdefault("list_interval_s", 0.05)
    return build_object_storage(
        ObjectStorageConfig(url=url, **config), RunInfo(run_id="run1", run_dir=str(tmp_path))
    )


def read_all(reader, *, expect: int, timeout: float = 20.0) -> list[RolloutBatch]:
    """Exactly ``expect`` batches (fewer if they do not come within ``timeout``)."""
    got: list[RolloutBatch] = []
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        got += reader.read_batches(max_batches=expect - len(got), timeout=0.2)
    return got


def test_the_plugin_is_registered_and_keeps_the_run_under_its_prefix(tmp_path):
    registry = build_registry()
    record = registry.get("storage", "gcs")
    run = RunInfo(run_id="run1", run_dir=str(tmp_path / "run1"))
    default = record.build(record.config_class(), run)
    assert default.root == str(tmp_path / "run1" / "rollouts")
    shared = record.build(record.config_class(url=f"file://{tmp_path}/bucket/"), run)
    assert shared.root == f"file://{tmp_path}/bucket/run1"


@pytest.mark.parametrize("scheme", ["path", "file://"])
def test_batches_arrive_in_each_writers_order_through_a_pickled_handle(tmp_path, scheme):
    url = "" if scheme == "path" else f"file://{tmp_path}/bucket"
    storage = storage_at(tmp_path, url)
    remote = pickle.loads(pickle.dumps(storage))  # what a rollout worker receives
    a, b = remote.writer(name="rollout-0"), remote.writer(name="rollout-1")
    assert a.name != b.name and a.name.startswith("rollout-0-")
    for i in range(5):
        a.write_batch(make_batch("a", i), timeout=5)
        b.write_batch(make_batch("b", i), timeout=5)
    reader = storage.reader()
    got = read_all(reader, expect=10)
    assert sorted(key(g) for g in got) == sorted([("a", i) for i in range(5)] +
                                                 [("b", i) for i in range(5)])  # fmt: skip
    assert [i for w, i in map(key, got) if w == "a"] == list(range(5))
    assert got[0].groups[0].rollouts[1].response_tokens.tolist() == [0, 1]
    assert reader.read_batches(max_batches=10, timeout=0.05) == []
    # No half-written or temporary object is ever left where a reader looks.
    names = os.listdir(os.path.join(storage.bucket().path, "writers", a.name))
    assert sorted(names) == [f"{i:012d}.arrow" for i in range(5)]


WRITER_SCRIPT = """
import pickle, sys
sys.path.insert(0, {tests!r})
from test_object_storage import make_batch
storage = pickle.loads(bytes.fromhex(sys.argv[1]))
writer = storage.writer(name="rollout-" + sys.argv[2])
for i in range(int(sys.argv[3])):
    writer.write_batch(make_batch(sys.argv[2], i), timeout=60)
"""


def test_writer_processes_a_killed_writer_and_a_restarted_reader_deliver_exactly_once(
    tmp_path, backend
):
    """Three writer processes (one killed mid-run, started again under a new name) and a
    reader stopped mid-way and started again from its saved position: every batch published is
    read once, none twice, none damaged."""
    import signal

    storage = storage_at(tmp_path, backend, max_unread_batches=4)
    script = WRITER_SCRIPT.format(tests=os.path.dirname(__file__))
    handle = pickle.dumps(storage).hex()

    def start(who: str, n: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", script, handle, who, str(n)])

    writers = [start("0", 10), start("1", 10), start("k", 1000)]
    reader = storage.reader()
    first: list[RolloutBatch] = []
    while sum(1 for b in first if key(b)[0] == "k") < 3:  # the doomed writer got going
        first += read_all(reader, expect=1, timeout=60)
    writers[2].send_signal(signal.SIGKILL)  # wherever it is, mid-object maybe
    writers[2].wait(timeout=30)
    writers.append(start("k2", 5))  # its replacement, under a new name
    saved = json.loads(json.dumps(reader.position()))
    reader.read_batches(max_batches=3, timeout=1)  # read, then lost with the "trainer"
    resumed = storage.reader(saved)
    rest: list[RolloutBatch] = []
    deadline = time.monotonic() + 120
    live = [writers[0], writers[1], writers[3]]
    while any(w.poll() is None for w in live) and time.monotonic() < deadline:
        rest += resumed.read_batches(max_batches=64, timeout=0.2)  # writers wait for reads
    assert [w.wait(timeout=1) for w in live] == [0, 0, 0]
    rest += read_all(resumed, expect=10**6, timeout=1)
    keys = [key(b) for b in first + rest]
    assert len(keys) == len(set(keys)), "a batch was delivered twice"
    by_writer = {w: sorted(i for x, i in keys if x == w) for w in ("0", "1", "k", "k2")}
    assert by_writer["0"] == by_writer["1"] == list(range(10))
    assert by_writer["k2"] == list(range(5))
    killed = by_writer["k"]  # every batch it published, in order, from the start
    assert killed == list(range(len(killed))) and len(killed) >= 3
    assert resumed.counters["corrupt_batches"] == 0


def test_a_retried_write_after_a_lost_reply_is_stored_once(tmp_path, monkeypatch, backend):
    storage = storage_at(tmp_path, backend)
    writer, reader = storage.writer(name="w"), storage.reader()
    bucket = storage.bucket()
    put = bucket.put

    def lost_reply(rel, data):
        put(rel, data)  # stored, then the answer is lost
        raise ConnectionError("connection reset")

    monkeypatch.setattr(bucket, "put", lost_reply)
    with pytest.raises(ConnectionError):
        writer.write_batch(make_batch("w", 0), timeout=1)
    monkeypatch.setattr(bucket, "put", put)
    writer.write_batch(make_batch("w", 0), timeout=1)  # the rollout worker's retry
    writer.write_batch(make_batch("w", 1), timeout=1)
    assert [key(b) for b in read_all(reader, expect=2)] == [("w", 0), ("w", 1)]
    assert reader.read_batches(max_batches=10, timeout=0.1) == []


def test_a_damaged_object_is_counted_and_skipped_and_a_missing_one_skipped_in_time(tmp_path):
    storage = storage_at(tmp_path, gap_timeout_s=0.3)
    writer, reader = storage.writer(name="w"), storage.reader()
    writer.write_batch(make_batch("w", 0), timeout=1)
    folder = os.path.join(storage.bucket().path, "writers", writer.name)
    with open(os.path.join(folder, "000000000001.arrow"), "wb") as f:
        f.write(b"ARROW1 but cut short")  # a writer killed mid-object on a store without renames
    with open(os.path.join(folder, ".000000000002.arrow.1234.tmp"), "wb") as f:
        f.write(b"half")  # what a killed local writer leaves: never read
    writer._seq = 3  # batch 2 never arrived (a writer that gave up on it); 3 did
    writer.write_batch(make_batch("w", 3), timeout=1)
    got = read_all(reader, expect=2, timeout=5)
    assert [key(b) for b in got] == [("w", 0), ("w", 3)]
    assert reader.counters["corrupt_batches"] == 1 and reader.counters["skipped_gaps"] == 1


def test_a_writer_waits_while_too_many_of_its_batches_are_unread(tmp_path):
    storage = storage_at(tmp_path, max_unread_batches=2)
    writer, reader = storage.writer(name="w"), storage.reader()
    writer.write_batch(make_batch("w", 0), timeout=1)
    writer.write_batch(make_batch("w", 1), timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"2 batches of w-.* are still unread after 0.3 s.*"
                       r"max_unread_batches"):  # fmt: skip
        writer.write_batch(make_batch("w", 2), timeout=0.3)
    assert time.monotonic() - start < 5
    assert [key(b) for b in read_all(reader, expect=2)] == [("w", 0), ("w", 1)]
    writer.write_batch(make_batch("w", 2), timeout=5)  # room again once read
    assert [key(b) for b in read_all(reader, expect=1)] == [("w", 2)]


@pytest.mark.parametrize("retention", ["checkpointed", "keep"])
def test_retention_deletes_only_what_a_checkpoint_holds(tmp_path, retention, backend):
    storage = storage_at(tmp_path, backend, retention=retention)
    writer, reader = storage.writer(name="w"), storage.reader()
    for i in range(4):
        writer.write_batch(make_batch("w", i), timeout=1)
    reader.read_batches(max_batches=2, timeout=1)
    checkpoint = reader.position()
    reader.read_batches(max_batches=1, timeout=1)  # read after the checkpoint: kept
    reader.checkpointed(checkpoint)
    bucket = storage.bucket()
    left = sorted(os.path.basename(e["name"]) for e in bucket.files(f"writers/{writer.name}"))
    kept = range(4) if retention == "keep" else range(2, 4)
    assert left == [f"{i:012d}.arrow" for i in kept]


def test_a_storage_that_does_not_answer_is_named_after_bounded_retries(tmp_path, monkeypatch):
    """A ``gs://`` bucket whose server refuses connections (an emulator address nothing
    listens on): the reader gives up after its retries with the URL and what to check."""
    pytest.importorskip("gcsfs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    storage = storage_at(tmp_path, "gs://no-such-bucket/rollouts", call_timeout_s=1.0, retries=1)
    reader = storage.reader()
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError) as raised:
        reader.read_batches(max_batches=1, timeout=0.1)
    assert time.monotonic() - start < 60
    message = str(raised.value)
    assert "gs://no-such-bucket/rollouts/run1" in message and "credentials" in message
    assert raised.value.exit_code == ExitCode.STORAGE


@pytest.mark.parametrize("where", [pytest.param("run_dir", marks=pytest.mark.slow), "gs"])
def test_a_job_on_gcs_storage_resumes_reading_after_its_checkpoint(
    cli, tiny_mock_job, tmp_path, request, where
):
    """``marinrl run --storage gcs`` (batches under the run directory, or on a bucket of the
    GCS emulator): the checkpoint keeps how far the trainer read each writer; the resumed job
    reads on from there, the first job's unread batches included, and deletes what its
    checkpoints hold."""
    from marin_rl_core.metrics import read_metrics

    url = ""
    if where == "gs":
        url = request.getfixturevalue("servers")("gs") + "/rollouts"
    common = [*tiny_mock_job, "--storage", "gcs", "--set", f'run_dir="{tmp_path}"',
              "--set", f'storage.url="{url}"',
              "--set", "trainer.checkpoint_interval_steps=3"]  # fmt: skip
    first = cli("run", *common, "--set", "trainer.num_train_steps=3", "--run-id", "r")
    assert first.exit_code == 0, first.output
    run = tmp_path / "r"
    state = json.loads((run / "checkpoints" / "step-000003" / "state.json").read_text())
    ((old_writer, read_upto),) = state["storage_position"]["writers"].items()
    assert read_upto >= 3 and old_writer.startswith("rollout-0-")
    again = cli("run", "--resume", str(run), "--set", "trainer.num_train_steps=5")
    assert again.exit_code == 0, again.output
    assert [r["step"] for r in read_metrics(run) if r["source"] == "train"] == [1, 2, 3, 4, 5]
    final = json.loads((run / "checkpoints" / "step-000005" / "state.json").read_text())
    cursors = final["storage_position"]["writers"]
    assert cursors[old_writer] >= read_upto  # the first job's writer, read on from there
    bucket = build_object_storage(
        ObjectStorageConfig(url=url), RunInfo(run_id="r", run_dir=str(run))
    ).bucket()
    assert json.loads(bucket.get("cursor.json"))["writers"]  # the run's batches went there
    for writer, upto in cursors.items():  # what a checkpoint holds is deleted, the rest kept
        left = sorted(os.path.basename(e["name"]) for e in bucket.files(f"writers/{writer}"))
        assert all(int(name.split(".")[0]) >= upto for name in left), (writer, upto, left)


def test_a_url_whose_filesystem_is_not_installed_is_a_config_error():
    from marin_rl_core.config import resolve_config
    from marin_rl_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'nosuch://bucket' cannot be opened.*\$\.storage"):
        resolve_config(
            build_registry(),
            selections={"env": "mock", "storage": "gcs"},
            overrides=['storage.url="nosuch://bucket"'],
        )


def test_a_job_whose_bucket_does_not_answer_stops_with_exit_14_naming_it(
    cli, tiny_mock_job, tmp_path, monkeypatch
):
    """Said before the job starts Ray and its workers (the storage's ``check``)."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a bucket that does not answer")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    result = cli("run", *tiny_mock_job, "--storage", "gcs", "--set", f'run_dir="{tmp_path}"',
                 "--set", 'storage.url="gs://no-such-bucket/r"', "--set",
                 "storage.call_timeout_s=2", "--set", "storage.retries=1",
                 "--run-id", "dead")  # fmt: skip
    assert result.exit_code == ExitCode.STORAGE, result.output
    assert "rollout storage gs://no-such-bucket/r/dead did not answer" in result.output
    assert "credentials" in result.output


@pytest.mark.slow
def test_a_bucket_that_stops_answering_is_named_by_the_watchdog(
    cli, tiny_mock_job, tmp_path, monkeypatch
):
    """A bucket that takes connections and never answers (slow, not refused: each call waits
    out ``call_timeout_s``): the watchdog's message names it and the call it is waiting on."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections are made, requests never answered
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        result = cli("run", *tiny_mock_job, "--storage", "gcs", "--set", f'run_dir="{tmp_path}"',
                     "--set", 'storage.url="gs://silent/r"', "--set", "storage.call_timeout_s=300",
                     "--set", "faults.stall_timeout_s=40", "--set", "faults.stop_timeout_s=5",
                     "--run-id", "slow")  # fmt: skip
    finally:
        silent.close()
    assert result.exit_code == ExitCode.STALLED, result.output
    assert "rollout storage is slow or does not answer" in result.output
    assert "on gs://silent/r/slow: no answer for" in result.output
