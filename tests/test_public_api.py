"""The public surface plugin authors use (issue 50): ``marin_rl_core`` itself, plus
``marin_rl_core.testing`` in tests. Every built-in plugin and every example package uses only
that; its heavy names are imported on first use, so importing it stays cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    plugins = sorted((ROOT / "plugins").glob("*.py"))
    examples = sorted(
        p
        for p in (ROOT / "examples").rglob("*.py")
        if not {"build", ".venv"} & set(p.relative_to(ROOT / "examples").parts)
    )
    return plugins + examples


def _core_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] == "marin_rl_core"]
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_examples_use_only_the_public_api(path):
    allowed = {"marin_rl_core"}
    if "tests" in path.parts or path.name.startswith("test_") or path.name == "conftest.py":
        allowed.add("marin_rl_core.testing")
    outside = [f"line {n}: {name}" for n, name in _core_imports(path) if name not in allowed]
    assert not outside, f"{path.name} imports core modules outside the public API: {outside}"


def test_every_public_name_resolves_and_importing_the_api_pulls_in_no_jax():
    import marin_rl_core

    for name in marin_rl_core.__all__:
        assert getattr(marin_rl_core, name) is not None, name
    probe = (
        "import sys, marin_rl_core; "
        "from marin_rl_core import TokenLoss, LOSS_AGGREGATIONS, absolute_run_dir; "
        "print(sorted(m for m in ('jax', 'levanter', 'ray') if m in sys.modules))"
    )
    # TokenLoss is in marin_rl_core.learner.loss: JAX comes with it, and only with it.
    cheap = "import sys, marin_rl_core; print(sorted(m for m in ('jax', 'levanter', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", cheap], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "jax" in out.stdout
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        marin_rl_core.NoSuchThing  # noqa: B018


def test_every_lazily_imported_name_is_in_the_authors_table():
    """A name added to the public API is one authors can find: writing-plugins.md lists it."""
    import marin_rl_core

    doc = (ROOT / "docs" / "writing-plugins.md").read_text()
    missing = [name for name in marin_rl_core.LAZY if f"`{name}" not in doc]
    assert not missing, f"public names docs/writing-plugins.md does not mention: {missing}"
