"""The gradient rules' layout and coverage: each rule lives in the rules module named like
its kernel's module, and each has a finite-difference case in the gradient tests (as every
claimed kernel has a case in ONNX's node tests)."""
from __future__ import annotations

import re
from pathlib import Path

import odt_ops.grad.rules  # noqa: F401 - registers every rule
from odt_ops.grad.registry import GRADIENTS
from odt_ops.kernels.registry import lookup

TESTS = Path(__file__).resolve().parent


def _family(module: str) -> str:
    return module.rsplit(".", 1)[1]


def test_each_rule_sits_in_the_rules_module_named_like_its_kernels():
    misplaced = []
    for (domain, op), rule in GRADIENTS.items():
        kernel = lookup(domain, op, 10_000)
        assert kernel is not None, f"{op} has a gradient rule but no kernel"
        if _family(rule.fn.__module__) != _family(kernel.fn.__module__):
            misplaced.append(f"{op}: rule in {rule.fn.__module__}, kernel in {kernel.fn.__module__}")
    assert not misplaced, misplaced


def test_each_rule_has_a_finite_difference_case():
    """Every rule's op is named in a gradient test (tests/odt_ops/test_gradients*.py check the
    rule against float64 finite differences through gradcheck)."""
    text = "".join(p.read_text(encoding="utf-8") for p in TESTS.glob("test_gradients*.py"))
    named = set(re.findall(r'"([A-Z][A-Za-z0-9]*)"', text))
    missing = sorted(op for (_, op) in GRADIENTS if op not in named)
    assert not missing, f"gradient rules without a finite-difference case: {missing}"
