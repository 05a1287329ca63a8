"""Print prefixkv's package import graph and exit 1 if it (or the module graph under it) has a cycle.

Every import counts, also those inside functions: a cycle hidden behind a function-level import is still a cycle.
A node is a subpackage (prefixkv.engine, prefixkv.kvcache, ...) or a top-level module (prefixkv.request, ...).

    python scripts/import_graph.py [--modules]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "prefixkv"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The prefixkv modules `path` imports (a `from package import name` counts as package.name if a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names}
            found.update(submodules & modules or {base})
    return {m for m in found if m in modules and m != name}


def node_of(module: str) -> str:
    """prefixkv.engine.scheduler -> prefixkv.engine; top-level modules and the package itself stay as they are."""
    parts = module.split(".")
    sub = ROOT.joinpath(*parts[1:2])
    return ".".join(parts[:2]) if len(parts) > 1 and sub.is_dir() else module


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in color and (cycle := visit(m)):
                return cycle
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color and (cycle := visit(n)):
            return cycle
    return None


def main(argv: list[str]) -> int:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    module_graph = {module_name(p): imports_of(p, modules) for p in paths}
    package_graph: dict[str, set[str]] = {}
    for module, deps in module_graph.items():
        edges = package_graph.setdefault(node_of(module), set())
        edges.update(node_of(d) for d in deps if node_of(d) != node_of(module))
    shown = module_graph if "--modules" in argv else package_graph
    for node in sorted(shown):
        print(f"{node} -> {', '.join(sorted(shown[node])) or '(nothing)'}")
    failed = 0
    for label, graph in (("package", package_graph), ("module", module_graph)):
        cycle = find_cycle(graph)
        if cycle:
            print(f"CYCLE in the {label} graph: {' -> '.join(cycle)}", file=sys.stderr)
            failed = 1
    if not failed:
        print("acyclic: the package graph and the module graph are DAGs")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
