"""The docs describe what the code has: every hook, command, exit code, plugin and config section."""

from __future__ import annotations

import tomllib
from pathlib import Path

import attrs
import pytest

from marin_rl_core import ExitCode, build_registry, hookspecs
from marin_rl_core.config import RLJobConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def read(name: str) -> str:
    return (DOCS / name).read_text()


@pytest.mark.parametrize("hook", sorted(n for n in dir(hookspecs) if n.startswith("marinrl_")))
def test_every_hook_is_documented(hook):
    assert f"### `{hook}`" in read("hooks.md")
    assert getattr(hookspecs, hook).__doc__, f"{hook} needs a docstring"


def _protocol_members() -> list[tuple[str, str]]:
    """Every protocol's members as a plugin author meets them: its methods and attributes, and
    the optional ones its docstring lists under "Optional members" (``* ``name``...``)."""
    import ast
    import re

    from marin_rl_core import protocols

    tree = ast.parse(Path(protocols.__file__).read_text())
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and any(
            getattr(base, "id", "") == "Protocol" for base in node.bases
        )):  # fmt: skip
            continue
        names = [n.name for n in node.body if isinstance(n, ast.FunctionDef)]
        names += [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
        optional = (ast.get_docstring(node) or "").partition("Optional members")[2]
        names += re.findall(r"^\s*\* ``(\w+)", optional, flags=re.MULTILINE)
        names += re.findall(r"^\s*\* ``\w+``, ``(\w+)``", optional, flags=re.MULTILINE)
        found += [(node.name, n) for n in names if not n.startswith("_")]
    import dataclasses

    found += [("LossPlan", f.name) for f in dataclasses.fields(protocols.LossPlan)]
    return found


@pytest.mark.parametrize(("protocol", "member"), _protocol_members())
def test_every_protocol_member_and_optional_member_is_in_hooks_md(protocol, member):
    """hooks.md is where plugin authors look (issue 50): each method, attribute and optional
    member of the contracts, and each field of a loss's plan, is there by name,
    ``create_prepare_fn`` with its signature."""
    hooks = read("hooks.md")
    assert f"`{member}" in hooks, f"docs/hooks.md does not mention {protocol}.{member}"
    if member == "create_prepare_fn":
        assert "`create_prepare_fn(reference_model, train_model) -> fn(model, batches)" in hooks


@pytest.mark.parametrize(
    "command",
    [
        "run",
        "eval PATH",
        "export RUN_DIR OUT_DIR",
        "report RUN_DIR",
        "plugins list",
        "config show",
        "config validate FILE",
    ],
)
def test_every_command_is_documented(command):
    assert f"## `marinrl {command}" in read("cli.md")


@pytest.mark.parametrize("code", list(ExitCode), ids=lambda c: c.name)
def test_every_exit_code_is_documented(code):
    assert f"| {int(code)} | `{code.name}` |" in read("cli.md")


@pytest.mark.parametrize("entry", build_registry().entries(), ids=lambda e: f"{e.kind}:{e.name}")
def test_every_builtin_plugin_and_its_keys_are_documented(entry):
    text = read("plugins.md")
    assert f"## `{entry.name}`" in text
    for field in attrs.fields(entry.record.config_class):
        assert f"`{field.name}`" in text, f"{entry.name}.{field.name} is not in docs/plugins.md"


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(RLJobConfig)])
def test_every_config_section_is_documented(field):
    assert f"`{field}`" in read("configuration.md") or f"`[{field}]`" in read("configuration.md")


def test_writing_plugins_walks_through_the_shipped_example():
    example = Path(__file__).resolve().parents[1] / "examples" / "marinrl-echo"
    project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    text = read("writing-plugins.md")
    assert f'name = "{project["name"]}"' in text and f'version = "{project["version"]}"' in text
    for name, target in project["entry-points"]["marinrl"].items():
        assert f'{name} = "{target}"' in text


def test_the_fault_table_names_real_tests_and_documented_exit_codes():
    """docs/faults.md's table stays in sync: each named test exists, each code is an ExitCode."""
    import re

    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    rows = [
        line for line in read("faults.md").splitlines() if line.startswith("| ") and "`" in line
    ]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(test_\w+)`", cells[3]):
            assert f"def {name}(" in tests, f"docs/faults.md names {name}, which does not exist"
        for code, name in re.findall(r"(\d+) `([A-Z_]+)`", cells[2]):
            assert ExitCode[name] == int(code), row
