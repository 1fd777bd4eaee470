"""Every op of ONNX's default domain is accounted for in one place: it trains (kernel and
gradient rule), it runs and is not differentiable (with the reason), it is rewritten at load
into ops that train (ONNX function bodies, recurrent ops), or it is not supported (with the
reason). Nothing is silently missing and no entry is stale."""
from __future__ import annotations

from onnx import defs

import odt_ops.grad.rules  # noqa: F401 - registers every rule
from odt_ops.coverage import NOT_DIFFERENTIABLE, NOT_SUPPORTED
from odt_ops.grad.registry import GRADIENTS
from odt_ops.ir.recurrent import RECURRENT_OPS
from odt_ops.kernels import registered_ops

OPS = sorted({s.name for s in defs.get_all_schemas_with_history() if s.domain == "" and not defs.get_schema(s.name).deprecated})


def _function_op(op: str) -> bool:
    schema = defs.get_schema(op)
    return bool(schema.function_opset_versions or schema.context_dependent_function_opset_versions)


def test_every_default_domain_op_is_accounted_for():
    kernels = {op for domain, op in registered_ops() if domain == ""}
    rules = {op for domain, op in GRADIENTS if domain == ""}
    unaccounted = []
    for op in OPS:
        if op in kernels:
            ok = op in rules or op in NOT_DIFFERENTIABLE
        else:
            ok = _function_op(op) or op in RECURRENT_OPS or op in NOT_SUPPORTED
        if not ok:
            unaccounted.append(op)
    assert not unaccounted, f"ops neither trained, rewritten nor listed with a reason: {unaccounted}"


def test_no_entry_is_stale():
    kernels = {op for domain, op in registered_ops() if domain == ""}
    rules = {op for domain, op in GRADIENTS if domain == ""}
    assert not [op for op in NOT_DIFFERENTIABLE if op in rules or op not in kernels], "listed as not differentiable yet has a rule or no kernel"
    assert not [op for op in NOT_SUPPORTED if op in kernels or _function_op(op)], "listed as unsupported yet runs"
    assert set(NOT_DIFFERENTIABLE) | set(NOT_SUPPORTED) <= set(OPS)
