"""No import circles in odt_ops/ or pipeline/, counting imports made inside functions too (a
function-level import hides a circle from Python's import machinery, not from a reader).

Modules are nodes; ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to
``a.b``; a relative import is resolved against its package. A circle is a strongly connected
group of two or more modules, or a module importing itself."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odt_ops", "pipeline")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return {t for t in targets if t in modules}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules, and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_cycle_finder_sees_a_circle_closed_by_a_function_level_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("import b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    import a\n")
    modules = {"a": a, "b": b}
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == [["a", "b"]]


def test_no_import_circles():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == []
