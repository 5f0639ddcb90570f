"""What ``bench/device/all.sh`` runs on a lent GPU machine must import there: the image has no
pytest (bench/device/README.md), and a script that imports it stops at once, after the minutes
spent staging. A static check, since this machine has pytest: every module the scripts can
import (their own imports, any function's included, and those of the bench and marinrl modules
they import, followed through) is looked up; none may be pytest or a pytest plugin."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
NOT_ON_THE_IMAGE = ("pytest", "_pytest", "marin_rl_core.testing")


def _scripts() -> list[Path]:
    text = (BENCH / "device" / "all.sh").read_text()
    names = sorted(set(re.findall(r"\b([a-z_]+)\.py\b", text)))
    return [BENCH / f"{name}.py" for name in names]


def _file_of(module: str) -> Path | None:
    """The file of a bench module or of one of marin_rl_core's / plugins' (else None)."""
    if "." not in module and (BENCH / f"{module}.py").exists():
        return BENCH / f"{module}.py"
    if module.split(".")[0] not in ("marin_rl_core", "plugins"):
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _reached_from(script: Path) -> dict[str, str]:
    """Every module ``script`` can import, followed through bench and marinrl modules: the
    module -> the file that imports it."""
    reached: dict[str, str] = {}
    todo, done = [script], set()
    while todo:
        path = todo.pop()
        if path in done:
            continue
        done.add(path)
        for module in _imports(path):
            reached.setdefault(module, str(path.relative_to(ROOT)))
            nested = _file_of(module)
            if nested is not None:
                todo.append(nested)
    return reached


def test_the_scripts_all_sh_runs_are_found():
    names = {path.name for path in _scripts()}
    assert {"generation.py", "real_model.py", "scale.py", "attention.py"} <= names
    assert all(path.exists() for path in _scripts()), names


def test_nothing_the_device_benches_run_imports_pytest():
    offending = {
        f"{script.name}: {module} (imported by {where})"
        for script in _scripts()
        for module, where in _reached_from(script).items()
        if module in NOT_ON_THE_IMAGE or module.startswith("_pytest.")
    }
    assert not offending, sorted(offending)
