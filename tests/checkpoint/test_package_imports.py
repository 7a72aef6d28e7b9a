"""The checkpoint package's modules import each other without a cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import titan_npu.checkpoint

PACKAGE = "titan_npu.checkpoint"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith(PACKAGE + "."))
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            if cycle := visit(target, path + [module]):
                return cycle
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m, []))), None)


def test_no_checkpoint_module_imports_one_that_imports_it_back():
    folder = Path(titan_npu.checkpoint.__file__).parent
    files = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    assert "initial_load" in graph["manager"]  # the walk sees the package's imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))

