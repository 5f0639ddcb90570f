"""Shared fixtures for marinrl's own tests."""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

pytest_plugins = ["marin_rl_core.testing"]

_NO_TORCH_FOR_CHILDREN = "MARINRL_TESTS_SET_USE_TORCH"
"""Set beside ``USE_TORCH=0`` by the suite (not the user): an xdist worker inheriting both
takes torch back for itself."""

QUICK_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
"""XLA's CPU compiler without LLVM's optimizations, with its older fused-kernel emitter, and
generating each program's code in one piece (not split across threads, which on 2 cores cost a
fifth more CPU): the suite's programs are tiny and run a few times each, so compiling them is
most of an in-process test's time; these flags halve it (docs/development.md#tests). What is
computed is the same
program; only how well the CPU code is optimized differs. ``MARINRL_TESTS_OPTIMIZED_XLA=1``
compiles as a user's job does."""


def pytest_configure(config: pytest.Config) -> None:
    """What every process of the suite shares (docs/development.md#tests):

    * XLA's quick CPU compile (:data:`QUICK_COMPILE_XLA_FLAGS`) in ``XLA_FLAGS``, inherited by
      every process the tests start; a test that simulates devices appends its device count.
    * One JAX compilation cache for the whole run, new each run: the pytest processes (xdist's
      workers too, which inherit the environment of the process that starts them) and every job
      they start compile a program once between them.
    * One marinrl cache (``MARINRL_CACHE_DIR``) for the whole run, new each run: the memory
      check counts a model's parameters once (:mod:`marin_rl_core.job.counts`), and nothing is
      written under the user's own ``~/.cache/marinrl``.
    * ``OMP_NUM_THREADS=1`` (unless set): torch's OpenMP threads spin while waiting for work,
      which doubled a torch test's CPU beside the other xdist worker.
    * The processes the tests start (Ray workers, ``marinrl`` subprocesses) do not import torch.
      The test extra installs torch only to write tiny checkpoints and compare with transformers
      in the pytest process; a user's ``pip install marin-rl`` has none, and with it installed
      ``import levanter`` pulls it in through transformers, doubling each process's start-up
      (8.6 s against 4.3 s on a 2-core machine). transformers decides at its import whether torch
      is there, so this process imports it first, then sets ``USE_TORCH=0`` for its children.
    """
    import os
    import shutil
    import tempfile

    # Before torch is imported: OpenMP threads that spin while they wait for work took twice
    # the CPU of one thread beside the other xdist worker (a torch test, 34 s against 16 s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("MARINRL_TESTS_OPTIMIZED_XLA") != "1":
        # Before any process compiles; the user's own XLA_FLAGS come after, so theirs win.
        given = os.environ.get("XLA_FLAGS", "")
        ours = [flag for flag in QUICK_COMPILE_XLA_FLAGS if flag.split("=")[0] not in given]
        os.environ["XLA_FLAGS"] = " ".join([*ours, given]).strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        cache = tempfile.mkdtemp(prefix="marinrl-test-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    if "MARINRL_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        cache = tempfile.mkdtemp(prefix="marinrl-test-cache-")
        os.environ["MARINRL_CACHE_DIR"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    # xdist's controller runs no test: it only hands its environment to the workers (they take
    # torch back for themselves), so it imports neither JAX nor transformers (2 CPU-s at the
    # start, beside both workers' collection).
    runs_tests = not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")
    if runs_tests:
        from marin_rl_core.job import compile_cache

        compile_cache.enable("auto")
    if os.environ.get(_NO_TORCH_FOR_CHILDREN) == "1":  # an xdist worker: a pytest process
        os.environ.pop("USE_TORCH", None)
    elif "USE_TORCH" in os.environ:
        return  # the user's own setting, kept
    if runs_tests:
        import transformers.utils.import_utils  # noqa: F401  (decides that torch is here, for this process)

    os.environ["USE_TORCH"] = "0"
    os.environ[_NO_TORCH_FOR_CHILDREN] = "1"


SLOWEST_FILES_FIRST = (
    "test_faults.py", "test_third_party_plugin.py", "test_sharding.py", "test_agent_endpoint.py",
    "test_lora.py", "test_colocation.py", "test_object_storage.py", "test_episodes.py",
    "test_code_env.py", "test_losses.py", "test_judge.py", "test_job.py", "test_ray_cluster.py",
    "test_trainer_group.py", "test_inference.py", "test_hf_models.py",
    "test_builtin_plugin_contracts.py", "test_agent_tools.py", "test_memory_storage.py",
    "test_weight_transfer.py",
)  # fmt: skip
"""The test files that take longest (each 20-220 s on the 2-core machine, 2026-12-01), longest
first; the others follow in their usual order. ``nox -s tests`` hands files to its xdist
workers in collection order (``--no-loadscope-reorder``; xdist's own order is by number of
tests, which put the files of few long jobs last): long files first, so no worker is left
running one long file alone at the end (docs/development.md#tests)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files by :data:`SLOWEST_FILES_FIRST`; the tests of each file stay in order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Install a distribution the way ``pip install --target`` lays it out (modules plus a
    ``.dist-info`` with ``entry_points.txt``) into a fresh directory on ``sys.path``.

    ``importlib.metadata`` discovers it like any installed package, so entry-point loading is
    exercised for real; the directory disappears with the test.
    """

    def install(
        name: str,
        version: str,
        *,
        entry_points: Mapping[str, str],
        modules: Mapping[str, str],
    ) -> Path:
        root = tmp_path / f"site-{name}"
        root.mkdir()
        for module, source in modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
        dist_info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        lines = "".join(f"{ep} = {target}\n" for ep, target in entry_points.items())
        (dist_info / "entry_points.txt").write_text(f"[marinrl]\n{lines}")
        monkeypatch.syspath_prepend(str(root))
        return root

    return install


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _ray_logs_to_current_stderr() -> None:
    """Ray's console log handler keeps the ``sys.stderr`` of the moment Ray first set up its
    logging. In-process CLI tests swap ``sys.stderr`` for each invocation (and close it after),
    so a later invocation's Ray line ("Started a local Ray instance") would hit a closed stream:
    "--- Logging error ---" in that test's output. (A real ``marinrl`` is one process.)"""
    for handler in logging.getLogger("ray").handlers:
        if type(handler).__name__ == "PlainRayHandler":
            handler.stream = _CurrentStderr()  # type: ignore[attr-defined]  (setStream flushes the old one)


@pytest.fixture(scope="session")
def cli() -> Callable[..., object]:
    """Invoke ``marinrl`` in-process: ``cli("plugins", "list")`` returns a click Result. (Each
    invocation is isolated; session-wide so that module fixtures can run a job for several
    tests.)"""
    from marin_rl_core.cli.app import app

    runner = CliRunner()

    def invoke(*args: str) -> object:
        _ray_logs_to_current_stderr()
        try:
            return runner.invoke(app, list(args), catch_exceptions=False)
        finally:
            _ray_logs_to_current_stderr()  # Ray may have set its logging up in this one

    return invoke


@pytest.fixture(scope="session")
def start_local_ray() -> Callable[[int], Any]:
    """``start_local_ray(num_cpus)``: a test file's own local Ray, started as a local
    ``marinrl run`` starts its own (``LocalRay``: lean, on loopback, the workers forked from a
    fork server at this process's niceness); returns it, for the file's fixture to ``stop()``
    (which gives ``RAY_AUTH_MODE`` back too)."""

    def start(num_cpus: int) -> Any:
        from marin_rl_core.job.local_ray import LocalRay

        local = LocalRay()
        local.start(num_cpus)
        return local

    return start


@pytest.fixture(scope="session")
def tiny_mock_job() -> tuple[str, ...]:
    """``marinrl run`` arguments of the smallest job the CLI tests run: the mock env, batches of
    32, eval only at the start and the end (append ``--set``/``--run-id`` as needed). A tuple:
    module fixtures that run one job for several tests use it too."""
    return (
        "--env",
        "mock",
        "--set",
        "trainer.batch_size=32",
        "--set",
        "sampling.n_prompts=4",
        "--set",
        "eval.n_examples=8",
        "--set",
        "eval.frequency=100",
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[Callable[[str], str]]:
    """gcp-storage-emulator (for gs://) and moto (for s3://) on loopback, with the environment
    gcsfs, s3fs and TensorStore (levanter's checkpoints) read set in this process (writer
    subprocesses and Ray workers inherit it). Yields ``new_bucket(scheme)``: the URL of a fresh
    bucket (``gs://marinrl-1a2b...``) on the server of ``scheme``."""
    import os
    import uuid

    from marin_rl_core.testing import free_port, serve_on_loopback

    pytest.importorskip("gcsfs")
    pytest.importorskip("s3fs")
    bin_dir = os.path.dirname(sys.executable)
    gcs_port, s3_port = free_port(), free_port()
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{gcs_port}",
        # Newer gcsfs probes the bucket for hierarchical namespaces; the emulator stalls it 60 s.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # TensorStore's gcs driver (checkpoints on gs://): the emulator, and a dummy token.
        "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{gcs_port}",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "eu-west-1",  # moto rejects LocationConstraint us-east-1
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs = []
    for argv, port in (
        ([os.path.join(bin_dir, "gcp-storage-emulator"), "start", "--host", "127.0.0.1",
          "--port", str(gcs_port), "--in-memory"], gcs_port),
        ([os.path.join(bin_dir, "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)], s3_port),
    ):  # fmt: skip
        proc = serve_on_loopback(argv, port)
        if proc is None:
            pytest.fail(f"{argv[0]} did not start listening on port {port}")
        procs.append(proc)

    def new_bucket(scheme: str) -> str:
        import fsspec

        name = f"marinrl-{uuid.uuid4().hex[:10]}"
        fs, _ = fsspec.core.url_to_fs(f"{scheme}://{name}", skip_instance_cache=True)
        fs.mkdir(name, **({"region_name": "eu-west-1"} if scheme == "s3" else {}))
        return f"{scheme}://{name}"

    try:
        yield new_bucket
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
