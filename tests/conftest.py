"""Shared fixtures for marinrl's own tests."""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest_plugins = ["marin_rl_core.testing"]


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


@pytest.fixture
def cli() -> Callable[..., object]:
    """Invoke ``marinrl`` in-process: ``cli("plugins", "list")`` returns a click Result."""
    from marin_rl_core.cli.app import app

    runner = CliRunner()

    def invoke(*args: str) -> object:
        _ray_logs_to_current_stderr()
        try:
            return runner.invoke(app, list(args), catch_exceptions=False)
        finally:
            _ray_logs_to_current_stderr()  # Ray may have set its logging up in this one

    return invoke


@pytest.fixture
def tiny_mock_job() -> list[str]:
    """``marinrl run`` arguments of the smallest job the CLI tests run: the mock env, batches of
    32, eval only at the start and the end (append ``--set``/``--run-id`` as needed)."""
    return [
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
    ]
