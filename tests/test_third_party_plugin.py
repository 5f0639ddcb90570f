"""The third-party path: pip-install the example plugin package and use its env by name."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl_core.testing import check_plugin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "marinrl-echo"


@pytest.fixture(scope="module")
def installed_echo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install`` the example package into its own directory (not the test env)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
    )
    return target


def marinrl(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "marin_rl_core", *args], capture_output=True, text=True, env=env
    )


def test_installed_plugin_is_listed_with_its_distribution_and_version(installed_echo):
    result = marinrl(installed_echo, "plugins", "list", "--json", "--kind", "env")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["echo"]["distribution"] == "marinrl-echo"
    assert rows["echo"]["version"] == "0.2.0"
    assert rows["echo"]["plugin"] == "echo"
    assert "math" in rows  # the built-ins are still there


def test_run_config_resolves_the_installed_env_by_name(installed_echo):
    result = marinrl(installed_echo, "config", "show", "--env", "echo", "--set", "env.length=3")
    assert result.returncode == 0, result.stderr
    import tomllib

    data = tomllib.loads(result.stdout)
    assert data["env"] == {"name": "echo", "length": 3, "max_value": 9}
    assert [lesson["env"] for lesson in data["curriculum"]["lessons"]] == ["echo"]


def test_not_installed_means_unknown(installed_echo):
    result = marinrl(Path("/nonexistent"), "config", "show", "--env", "echo")
    assert result.returncode == 4
    assert "unknown env 'echo'" in result.stderr


def test_example_plugin_honours_the_env_contract(installed_echo, plugin_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_echo))
    module = importlib.import_module("marinrl_echo")
    registry = plugin_registry(module)
    assert registry.names("env") == ["echo"]
    check_plugin(registry.get("env", "echo"))
