"""The api package's structure: one place for errors, no import cycles, none hidden in functions."""

from __future__ import annotations

import ast
from pathlib import Path

import purestep.api as api
from purestep.api import errors

ROOT = Path(api.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(sibling modules imported at module level outside `if TYPE_CHECKING`, function-level sibling imports)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    package = [p for p in package if p]

    def targets(node: ast.ImportFrom) -> list[str]:
        base = package[: len(package) - (node.level - 1)] if node.level else None
        if base is None:
            return []
        mod = [*base, *(node.module.split(".") if node.module else [])]
        found = []
        for alias in node.names:
            candidate = ".".join([*mod, alias.name])
            as_module = ROOT.joinpath(*candidate.split(".")).with_suffix(".py").exists() or ROOT.joinpath(*candidate.split(".")).is_dir()
            found.append(candidate if as_module else ".".join(mod))
        return [f for f in found if f]

    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.update(targets(node))
    hidden = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn) if isinstance(node, ast.ImportFrom) and node.level
    ]
    return top, hidden


def test_no_sibling_import_hides_in_a_function_and_the_modules_import_without_cycles():
    graph, hidden = {}, []
    for path in sorted(ROOT.rglob("*.py")):
        top, inner = _imports(path)
        graph[_module_name(path)] = top
        hidden += inner
    assert not hidden, f"function-level imports of api modules: {hidden}"
    assert {"config", "_build", "checkpoint", "checkpoint._io", "trainer"} <= set(graph)
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*stack, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_every_api_error_class_lives_in_the_errors_module():
    defined = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases
            ):
                defined.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert defined and all(d.startswith("errors.py:") for d in defined), defined
    for name in ("ConfigError", "CheckpointError", "RunDirError"):
        assert getattr(api, name) is getattr(errors, name)
