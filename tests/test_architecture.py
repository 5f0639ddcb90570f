"""The core's layout holds (docs/architecture.md): no import cycles between its modules, imports
inside functions included, and imports point down the layers only; the rollout side and the
learner side never import each other. Read from the source with an AST walk, so it stays true
whatever a test run happens to import."""

from __future__ import annotations

import ast
from pathlib import Path

import marin_rl_core

CORE = Path(marin_rl_core.__file__).parent

LAYERS = {
    # the contracts a plugin author reads first, and the run's file formats
    "": 0,
    "models": 1,
    "config": 2,
    "rollout": 3,
    "learner": 3,
    "testing": 4,
    "tiny_checkpoints": 3,  # the tiny Hugging Face checkpoints testing re-exports
    "engine_contract": 3,  # the engine contract check testing re-exports
    "storage_contract": 3,  # the storage contract check testing re-exports
    "job": 5,
    "cli": 6,
    "__main__": 7,
}
"""Each module's layer, by its subpackage (``""`` = a module at the top). A module imports only
modules of its own layer or lower ones; rollout and learner, on the same layer, never each
other."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]  # a module at the top, unless it is a subpackage itself
    return parts[0] if parts and (len(parts) > 1 or parts[0] in LAYERS) else ""


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str]) -> dict[str, int]:
    """The core modules ``path`` imports at run time (module level or inside functions; not
    under ``if TYPE_CHECKING``), each with the line of its first import."""
    found: dict[str, int] = {}
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import module` imports the module; `from module import name` the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            if target in modules and target != module_name(path):
                found.setdefault(target, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def graph() -> dict[str, dict[str, int]]:
    paths = {module_name(p): p for p in CORE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def test_the_layout_is_what_the_map_in_the_docs_says():
    packages = {p.name for p in CORE.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"config", "models", "rollout", "learner", "job", "cli"}
    architecture = (CORE.parent / "docs" / "architecture.md").read_text()
    for package in packages:
        assert f"marin_rl_core/{package}/" in architecture, package


def test_the_map_in_the_docs_names_every_module():
    """docs/architecture.md's "Where the code is" names each module where a reader looks for it
    (issue 50: it had left out nine)."""
    architecture = (CORE.parent / "docs" / "architecture.md").read_text()
    where = architecture.split("## Where the code is", 1)[1]
    missing = [
        module_name(p)
        for p in sorted(CORE.rglob("*.py"))
        if p.stem not in {"__init__", "__main__"}
        and f"`{p.stem}`" not in where
        and f"`marin_rl_core/{p.name}`" not in where
    ]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_imports_point_down_the_layers_and_the_two_sides_stay_apart():
    wrong = []
    for module, imports in graph().items():
        mine = layer_of(module)
        for target, line in imports.items():
            theirs = layer_of(target)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(
                    f"{module} (line {line}) imports {target}: {mine or 'top'} -> {theirs}"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_not_even_through_imports_inside_functions():
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            # A package's __init__ re-exporting its modules is not a cycle with them.
            if nxt == node.rpartition(".")[0] or node == nxt.rpartition(".")[0]:
                continue
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_holds_two_jobs():
    """A module over 500 lines is a sign it holds two things (issues 25 and 50): split it where
    its parts meet, rather than squeeze it."""
    long = {
        module_name(p): n
        for p in CORE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
