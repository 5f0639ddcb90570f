"""Metric rows reach metrics.jsonl and, when configured, tensorboard and wandb (offline)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.metrics import MetricsHub, read_metrics


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``, read back from the TFRecord frames."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]  # length, its crc, record, record crc
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_rows_go_to_jsonl_and_tensorboard(tmp_path):
    hub = MetricsHub(str(tmp_path), trackers=("jsonl", "tensorboard"), run_id="r1")
    hub.log({"reward": 0.25, "loss": 1.5}, step=1, source="train")
    hub.log({"eval/add_1digit/reward": 0.8}, step=2, source="eval")
    assert hub.latest()["eval/add_1digit/reward"] == 0.8 and hub.latest()["train_step"] == 1
    hub.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["source"]) for r in rows] == [(1, "train"), (2, "eval")]
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "r1")
    assert scalars["reward"] == [(1, 0.25)]
    assert scalars["loss"] == [(1, 1.5)]
    assert scalars["eval/add_1digit/reward"] == [(2, pytest.approx(0.8))]


def test_rows_go_to_an_offline_wandb_run_under_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    hub = MetricsHub(str(tmp_path), trackers=("wandb",), run_id="wandb-test-run")
    hub.log({"reward": 0.125, "frac_zero_variance_groups": 0.5}, step=3, source="train")
    hub.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-wandb-test-run/run-wandb-test-run.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    # The run's record log holds the logged keys and values (wandb has no offline reader).
    # wandb's service process may still be writing it when finish() returns on a busy machine.
    deadline = time.monotonic() + 30.0
    while True:
        data = runs[0].read_bytes()
        if (b"frac_zero_variance_groups" in data and b"0.125" in data) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert b"frac_zero_variance_groups" in data and b"0.125" in data, data[:200]


def test_unknown_tracker_is_a_config_error_at_its_path():
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord'.*@ \$\.logging\.tracker"):
        resolve_config(build_registry(), overrides=['logging.tracker=["jsonl", "tensorbord"]'])


def test_trackers_get_a_step_that_never_goes_back(tmp_path):
    """Rollout and eval rows carry the lagging weight step; wandb drops a row whose step is
    lower than one it has seen. Trackers get the newest step, metrics.jsonl keeps each row's."""
    hub = MetricsHub(str(tmp_path), trackers=("jsonl", "tensorboard"), run_id="r2")
    hub.log({"reward": 0.5}, step=5, source="train")
    hub.log({"rollout/reward": 0.25}, step=3, source="rollout")  # sampled with step-3 weights
    hub.log({"eval/a/reward": 0.75}, step=4, source="eval")
    hub.log({"reward": 0.6}, step=6, source="train")
    hub.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [5, 3, 4, 6]
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "r2")
    assert scalars["rollout/reward"] == [(5, 0.25)]
    assert scalars["eval/a/reward"] == [(5, 0.75)]
    assert [step for step, _ in scalars["reward"]] == [5, 6]


def test_a_resumed_run_keeps_one_set_of_rows_per_step_its_start_eval_included(tmp_path):
    """Resuming from the checkpoint of step 4 drops the rows the dead run logged after it, and
    the eval rows of step 4 itself: the resumed run evaluates its starting weights again (a
    finished run extended with a higher num_train_steps logged its final eval twice)."""
    hub = MetricsHub(str(tmp_path), trackers=("jsonl",), run_id="r")
    for step in range(1, 6):
        hub.log({"loss": 1.0}, step=step, source="train")
    hub.log({"eval/a/reward": 0.5}, step=4, source="eval")
    hub.log({"eval/a/reward": 0.6}, step=5, source="eval")
    assert hub.resume_at(4) == 3  # train 5, eval 5, eval 4
    hub.log({"eval/a/reward": 0.55}, step=4, source="eval")  # the resumed run's own
    hub.close()
    rows = [(r["step"], r["source"]) for r in read_metrics(tmp_path)]
    # The "run" row marks where the resumed run starts (the summary's seconds count each run's).
    assert rows == [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "run"), (4, "eval")]


def test_device_memory_is_the_most_over_devices_and_absent_where_unreported(monkeypatch):
    import resource

    import jax

    from marin_rl_core.metrics import device_memory

    # CPU devices report no memory statistics: the process's peak resident memory only.
    cpu = device_memory()
    assert set(cpu) == {"host_peak_rss_gib"}
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert 0.05 < cpu["host_peak_rss_gib"] <= held + 1e-6  # this pytest process: 100s of MiB

    class Device:
        def __init__(self, now, peak):
            self.stats = {"bytes_in_use": now * 2**30, "peak_bytes_in_use": peak * 2**30}

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(jax, "local_devices", lambda: [Device(1, 3), Device(2, 2.5)])
    got = device_memory()
    assert {k: got[k] for k in ("device_memory_gib", "device_peak_memory_gib")} == {
        "device_memory_gib": 2.0,
        "device_peak_memory_gib": 3.0,
    }
