"""The engine's packages import downwards only: ir/ (loading and graph passes) never imports
runtime/ (plans); both bind kernels through kernels/binding.py."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "odt_ops"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_ir_never_imports_the_runtime():
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("odt_ops.runtime")) for p in (ROOT / "ir").glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
