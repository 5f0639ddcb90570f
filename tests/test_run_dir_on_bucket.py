"""A run directory on a bucket (``--set run_dir=gs://...``): config, checkpoints, rollouts,
metrics, samples and logs on the GCS emulator; the run resumed from another machine's
directory (another working directory and an empty local cache); export and report read it
there."""

from __future__ import annotations

import json

import pytest

from marin_rl_core.errors import ExitCode
from marin_rl_core.metrics import read_metrics
from marin_rl_core.rundir import local_copy, run_path


def bucket_files(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    path = run_path(url)
    path.fs.invalidate_cache()
    return sorted(name[len(path.path) + 1 :] for name in path.fs.find(path.path))


@pytest.mark.slow
def test_a_job_with_its_run_directory_on_a_bucket_resumes_from_another_machine(
    cli, tiny_mock_job, tmp_path, monkeypatch, servers
):
    runs = servers("gs") + "/runs"
    run = f"{runs}/r"
    for machine in ("a", "b"):
        (tmp_path / machine).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path / "a" / "cache"))
    first = cli("run", *tiny_mock_job, "--storage", "gcs", "--set", f'run_dir="{runs}"',
                "--set", "trainer.num_train_steps=3", "--set",
                "trainer.checkpoint_interval_steps=2", "--run-id", "r")  # fmt: skip
    assert first.exit_code == 0, first.output
    assert f"writing to {run}" in first.output
    files = bucket_files(run)
    for name in ("config.toml", "checkpoints/latest", "checkpoints/step-000003/state.json",
                 "metrics.jsonl", "samples.jsonl", "driver.log", "logs/trainer.log",
                 "logs/rollout-0.log", "reward_curve.png"):  # fmt: skip
        assert name in files, (name, files)
    assert "rollouts/cursor.json" in files  # the rollouts went there too
    assert not (tmp_path / "a" / "runs").exists()  # nothing written to the working directory
    assert local_copy(run) == tmp_path / "a" / "cache" / "runs" / "gs" / run[len("gs://") :]

    # Another machine: another working directory, nothing cached.
    monkeypatch.chdir(tmp_path / "b")
    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path / "b" / "cache"))
    again = cli("run", "--resume", run, "--set", "trainer.num_train_steps=5")
    assert again.exit_code == 0, again.output
    assert [r["step"] for r in read_metrics(run) if r["source"] == "train"] == [1, 2, 3, 4, 5]
    samples = [json.loads(line)["step"] for line in
               (run_path(run) / "samples.jsonl").read_text().splitlines()]  # fmt: skip
    assert sorted(set(samples)) == [1, 2, 3, 4, 5]
    trainer_log = (run_path(run) / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and trainer_log.count("trainer process") == 2
    files = bucket_files(run)
    assert (run_path(run) / "checkpoints" / "latest").read_text() == "step-000005"
    kept = sorted({f.split("/")[1] for f in files if f.startswith("checkpoints/step-")})
    assert kept == ["step-000004", "step-000005"]  # the newest two are kept

    out = tmp_path / "b" / "hf"
    exported = cli("export", run, str(out))
    assert exported.exit_code == 0, exported.output
    assert f"exported step 5 of {run}" in exported.output and (out / "config.json").is_file()
    report = cli("report", run)
    assert report.exit_code == 0, report.output


def test_a_run_directory_on_a_missing_bucket_is_named_with_the_fix(
    cli, tiny_mock_job, servers, tmp_path, monkeypatch
):
    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path / "cache"))
    # (The GCS emulator makes buckets as they are written to; moto, like S3, does not.)
    result = cli("run", *tiny_mock_job, "--set", 'run_dir="s3://no-such-bucket-here/runs"',
                 "--run-id", "r")  # fmt: skip
    assert result.exit_code == ExitCode.RUN_DIR, result.output
    assert "cannot write the run directory s3://no-such-bucket-here/runs/r" in result.output
    assert "bucket exists" in result.output


def test_resuming_a_run_that_is_not_on_the_bucket_says_what_to_give(cli, servers):
    bucket = servers("gs")
    result = cli("run", "--resume", f"{bucket}/runs/nothing")
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert f"--resume {bucket}/runs/nothing: no such directory" in result.output


@pytest.mark.parametrize("run_dir", ["gs://b/runs/r", "s3://b/r/", "file:///tmp/r", "/tmp/r"])
def test_local_copies_of_runs_on_buckets_are_apart_and_local_runs_are_their_own(
    run_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path))
    expected = {
        "gs://b/runs/r": tmp_path / "runs" / "gs" / "b" / "runs" / "r",
        "s3://b/r/": tmp_path / "runs" / "s3" / "b" / "r",
        "file:///tmp/r": run_path("/tmp/r"),
        "/tmp/r": run_path("/tmp/r"),
    }
    assert local_copy(run_dir) == expected[run_dir]
