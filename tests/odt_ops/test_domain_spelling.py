"""The default domain's second spelling, "ai.onnx", is read in one place (odt_ops/domain.py):
every other module asks ``is_default``/``canonical``, so no check can forget one of the two.
Messages may still show the name (a constant inside an f-string)."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "odt_ops"


def _spellings(source: str) -> list[int]:
    """Lines of "ai.onnx" string constants outside f-strings."""
    tree = ast.parse(source)
    in_messages = {id(c) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for c in ast.walk(j)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "ai.onnx" and id(n) not in in_messages]


def test_the_finder_sees_a_check_and_spares_a_message():
    assert _spellings('ok = node.domain in ("", "ai.onnx")\nmsg = f"{d or \'ai.onnx\'}::Relu"\n') == [1]


def test_only_domain_py_spells_the_default_domain():
    sites = {f"{p.relative_to(ENGINE.parent)}:{line}" for p in ENGINE.rglob("*.py") if p.name != "domain.py"
             for line in _spellings(p.read_text(encoding="utf-8"))}
    assert not sites, f'"ai.onnx" spelled outside odt_ops/domain.py (use is_default/canonical): {sorted(sites)}'
