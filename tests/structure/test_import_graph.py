"""The package's import graph: no cycles (module-level or inside functions) and the layering the design states.

Every `import` / `from ... import` of a titan_npu module is an edge, wherever it stands (a function-level import that
only dodges a cycle is still the cycle); importing a.b.c also runs a/__init__ and a/b/__init__, so those are
edges too. Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "titan_npu"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every titan_npu module named by an import in `tree` (TYPE_CHECKING blocks left out)."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            stack.append(child)
    return {name for name in found if name == "titan_npu" or name.startswith("titan_npu.")}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the titan_npu modules importing it runs (package __init__ files included); read once per session, not
    to be changed by its callers."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            if target not in modules:
                continue  # a name imported from a module, not a module
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        edges.discard(name)
        # Only the ancestors of the importer itself are free (they run before it, not because of it).
        parts = name.split(".")
        edges -= {".".join(parts[:i]) for i in range(1, len(parts))}
        graph[name] = {e for e in edges if e in modules}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_parallel_imports_neither_models_nor_trainer() -> None:
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("titan_npu.parallel")
                 for t in ts if t.startswith(("titan_npu.models", "titan_npu.trainer")))
    assert not bad, f"parallel/ must not depend on models/ or trainer/: {bad}"


def test_only_the_registry_imports_a_model_family() -> None:
    graph = import_graph()
    families = {p.name for p in (PACKAGE / "models").iterdir() if (p / "spec.py").is_file()}
    bad = []
    for module, targets in graph.items():
        for target in targets:
            parts = target.split(".")
            if len(parts) < 3 or parts[:2] != ["titan_npu", "models"] or parts[2] not in families:
                continue
            inside = module.startswith(f"titan_npu.models.{parts[2]}") or module == "titan_npu.models.registry"
            if not inside:
                bad.append(f"{module} -> {target}")
    assert not bad, f"only titan_npu/models/registry.py may import a model family's modules: {sorted(bad)}"


def package_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """titan_npu's packages (its folders) -> the packages their modules import, each with the imports that do it.

    The modules at the top (errors.py, atomic.py, the entry points) are not packages and are left out."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in packages else None

    out: dict[str, dict[str, list[str]]] = {p: {} for p in sorted(packages)}
    for module, targets in sorted(graph.items()):
        source = package(module)
        for target in sorted(targets):
            dest = package(target)
            if source is not None and dest is not None and dest != source:
                out[source].setdefault(dest, []).append(f"{module} -> {target}")
    return out


def test_the_packages_import_each_other_without_loops() -> None:
    packages = package_graph(import_graph())
    found = cycles({p: set(targets) for p, targets in packages.items()})
    lines = []
    for component in found:
        lines.append(" <-> ".join(component))
        lines += [f"    {p} -> {q}: {packages[p][q][0]}" for p in component for q in component if q in packages[p]]
    assert not found, "packages that import each other (each a loop, with one import per edge):\n" + "\n".join(lines)


def test_outside_models_only_the_registry_spec_and_init_are_imported() -> None:
    # A family's folder and the shared MoE and decoder folders are the models package's own business: the trainer,
    # planner and checkpoint code reach them through the registry's ModelSpec.
    public = {"titan_npu.models", "titan_npu.models.registry", "titan_npu.models.spec", "titan_npu.models.init"}
    bad = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                 if not module.startswith("titan_npu.models")
                 for target in targets if target.startswith("titan_npu.models.") and target not in public)
    assert not bad, f"only models/registry.py, spec.py and init.py may be imported from outside models/: {bad}"


def test_the_graph_sees_function_level_and_relative_imports(tmp_path) -> None:
    source = "import os\n\ndef f():\n    from titan_npu.models import registry\n    from . import sibling\n"
    found = _imports(ast.parse(source), "titan_npu.parallel.x", is_package=False)
    assert {"titan_npu.models.registry", "titan_npu.parallel.sibling"} <= found
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    # Two packages whose modules import each other form a loop though no module does.
    modules = {"titan_npu.config.loader": {"titan_npu.models.registry"}, "titan_npu.models.registry":
               {"titan_npu.config.schema"}, "titan_npu.config.schema": set()}
    packages = package_graph(modules)
    assert cycles({p: set(targets) for p, targets in packages.items()}) == [["config", "models"]]


def _imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            return True
    return False


def test_only_the_command_mains_parse_the_command_line() -> None:
    allowed = {"titan_npu.cli"}
    bad = sorted(name for name, path in _modules().items()
                 if not (name in allowed or name.startswith("titan_npu.commands")) and _imports_argparse(path))
    assert not bad, f"argparse belongs in titan_npu/commands (one module per command), not in: {bad}"


def test_library_packages_never_import_the_command_mains() -> None:
    graph = import_graph()
    entries = {"titan_npu.cli", "titan_npu.train"}  # the dispatcher and train.py's entry point at them
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if not m.startswith("titan_npu.commands") and m not in entries
                 for t in ts if t.startswith("titan_npu.commands") or t in entries)
    assert not bad, f"library modules must not reach up to the command mains or the entry points: {bad}"
