"""The engine's packages import downwards only: neither ir/ (loading and graph passes) nor
kernels/ imports runtime/ (plans); both bind kernels through ir/binding.py, and the
runtime hands control-flow kernels its Plan as their subgraph compiler."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "odt_ops"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("package", ["ir", "kernels"])
def test_lower_layers_never_import_the_runtime(package):
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("odt_ops.runtime")) for p in (ROOT / package).glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
